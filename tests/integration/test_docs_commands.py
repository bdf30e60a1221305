"""Every ``lp-train`` command in the README and docs passes the checks lp-train runs before it starts a rank
(issue 42): a renamed group option, key or value makes this fail, not a reader's first try.

A command that names the reader's own files (a data file, a pretrained folder) may be refused for that reason
alone; one that adds the reader's config folder (``--config-dir``, ``hydra.searchpath``) and sweeps (``-m``, each
job composed by Hydra) are left out.
"""

import re
import shlex
from pathlib import Path

import pytest

from tests.integration.lp_train_checks import refusal

ROOT = Path(__file__).resolve().parents[2]
# Settings that name the reader's own files, and what lp-train says when the example's path is not there.
READERS_FILES = ("data.path", "data.val_path", "data.files", "model.pretrained")
MISSING = ("does not exist", "holds no config.json")


def _only_the_readers_files(overrides: list[str], line: str) -> bool:
    """True when ``line`` refuses one of the reader's own files that the command names."""
    paths = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] in READERS_FILES]
    return any(path in line for path in paths) and any(reason in line for reason in MISSING)


def _commands() -> dict[str, list[str]]:
    """``{overrides as one string: overrides}`` of every single-run ``lp-train`` command in the README and docs."""
    found = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())  # continuation lines
        for match in re.finditer(r"(?:^|[\s`$/])lp-train ([^`#\n|]*)", text, flags=re.M):
            args = match.group(1).strip()
            if any(skip in f" {args}" for skip in ("<", "...", " -m", "--multirun", "--config", " -c", "searchpath")):
                continue
            try:
                overrides = [a for a in shlex.split(args) if "=" in a and not a.startswith("-")]
            except ValueError:
                continue
            if overrides:
                found[" ".join(overrides)] = overrides
    return found


COMMANDS = _commands()


def test_the_docs_hold_commands_to_check():
    assert len(COMMANDS) >= 15, sorted(COMMANDS)
    # the README's first look
    assert "strategy=hybrid strategy.pipeline_parallel_size=2 strategy.tensor_parallel_size=1 trainer.max_steps=40" \
        in COMMANDS
    assert not _only_the_readers_files(["data.path=x.tsv"], "model.optimizer.lr=-1 is not a positive learning rate")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_docs_command_passes_lp_trains_checks(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = refusal(COMMANDS[command], tmp_path / "run")
    assert line == "" or _only_the_readers_files(COMMANDS[command], line), f"lp-train {command}\n  refused: {line}"
