"""The README is the front door: CI runs exactly its test command, it links every page of docs/, and its
Hugging Face example runs as written.

The checks on the documentation site itself (strict build, README length, links) are in test_docs.py.
"""

import importlib.util
import os
import re
import runpy
import sys
from pathlib import Path

import pytest

from tests.integration.forked_cli import run_function

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README
    assert "pytest" in ci and "[ $? -eq 5 ]" in ci


def test_the_two_set_up_commands_are_the_same_in_the_getting_started_page():
    commands = _code_blocks(_section(README, "Set up a fresh machine"), "bash")
    assert len(commands) == 2
    assert commands[0].strip().endswith(".venv/bin/lp-train")
    started = (ROOT / "docs" / "getting-started.md").read_text()
    assert all(command in started for command in commands)


def test_the_readme_links_every_page_of_the_docs():
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert "docs/index.md" in pages and len(pages) > 10
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", README))
    assert [page for page in pages if page not in linked] == []
    assert "docs/reference/index.md" in linked


def _hf_example() -> str:
    (example,) = _code_blocks(_section(README, "Hugging Face models in 20 lines"), "python")
    return example


def test_hugging_face_example_is_at_most_20_lines_and_the_docs_page_shows_the_same():
    example = _hf_example()
    assert len(example.splitlines()) <= 20
    assert example in (ROOT / "docs" / "hugging-face.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra (transformers)")
def _run_script(path: str) -> int:
    """As ``python <path>``: the file runs as ``__main__`` with ``sys.argv[0]`` its path (what Lightning re-runs)."""
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")
    return 0


def test_hugging_face_example_runs_as_written(tmp_path):
    """The README's example, unchanged: 2 CPU processes, tensor parallelism, 5 steps (Lightning re-runs the file)."""
    script = tmp_path / "hf_example.py"
    script.write_text(_hf_example())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # `python hf_example.py` forked from the session's fork server (its imports done); rank 1 is a new interpreter
    result = run_function(_run_script, (str(script),), [sys.executable, str(script)], tmp_path, env, 300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "`Trainer.fit` stopped: `max_steps=5` reached." in output
