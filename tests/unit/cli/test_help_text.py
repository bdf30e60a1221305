"""--help of the commands: plain text, examples, config groups, the docs (lightning_parallel.cli.help_text)."""

import contextlib
import sys

import pytest

from lightning_parallel.cli.help_text import COMPARE, TRAIN, hydra_app_help, plain
from lightning_parallel.runtime.config_dir import CONFIG_DIR


def test_plain_strips_restructuredtext_markup():
    text = plain("``lp-plan``: see :func:`~lightning_parallel.checkpoints.detect.identify_writer` and "
                 ":class:`lightning_parallel.layout.ParallelLayout`; every output::\n\n    lp-convert a b")
    assert text == ("lp-plan: see identify_writer and lightning_parallel.layout.ParallelLayout; every output:\n\n"
                    "    lp-convert a b")


def test_a_hydra_commands_help_has_a_description_three_examples_the_groups_and_the_docs():
    for spec in (TRAIN, COMPARE):
        page = hydra_app_help(**spec, config_dir=str(CONFIG_DIR))
        lines = page.splitlines()
        assert lines[0].startswith(f"usage: {spec['prog']} ")
        examples = lines[lines.index("Examples:") + 1:][:3]
        assert all(line.startswith(f"  {spec['prog']} ") and "# " in line for line in examples)
        assert any(line.startswith("  strategy: context, ddp, ") for line in lines) and "hybrid, pipeline" in page
        assert "Docs: docs/" in page and "powered by Hydra" not in page and "``" not in page
        assert max(len(line) for line in lines) <= 100


@pytest.mark.parametrize("prog", ["lp-train", "lp-compare", "lp-plan", "lp-convert"])
def test_each_commands_help_has_a_description_examples_the_docs_and_no_markup(prog, capsys, monkeypatch, tmp_path):
    from lightning_parallel.cli import compare, convert, plan, train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [prog, "--help"])
    entry = {"lp-train": train.main, "lp-compare": compare.main, "lp-plan": plan.main, "lp-convert": convert.main}
    with contextlib.suppress(SystemExit):  # argparse's --help exits 0
        entry[prog]()
    page = capsys.readouterr().out
    lines = page.splitlines()
    assert lines[0].startswith(f"usage: {prog}")
    description = next(line for line in lines[1:] if line.strip() and not line.startswith(" "))
    assert len(description) > 40, description
    examples = [line for line in lines if line.lstrip().startswith(f"{prog} ")]
    assert len(examples) >= 3, page
    assert "Docs: docs/" in page and "docs/index.md" in page
    for markup in ("``", ":func:", ":class:", ":mod:", "powered by Hydra", "::\n"):
        assert markup not in page, f"{markup!r} in {prog} --help"
    assert not list(tmp_path.iterdir())  # --help writes nothing (no run folder)
