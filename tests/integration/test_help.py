"""``--help`` of the four installed commands: a description, at least 3 examples, the docs, no markup (issue 42)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.entry_point import entry_point_env

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("prog", ["lp-train", "lp-compare", "lp-plan", "lp-convert"])
def test_help_describes_the_command_with_examples_and_the_docs_in_plain_text(prog, tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / prog), "--help"], cwd=tmp_path, env=entry_point_env(),
                          capture_output=True, text=True, timeout=300)
    page = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    lines = page.splitlines()
    assert lines[0].startswith(f"usage: {prog}")
    description = next(line for line in lines[1:] if line.strip() and not line.startswith(" "))
    assert len(description) > 40, description
    examples = [line for line in lines if line.lstrip().startswith(f"{prog} ") and not line.startswith("usage")]
    assert len(examples) >= 3, page
    assert "Docs: docs/" in page and "docs/index.md" in page
    for markup in ("``", ":func:", ":class:", ":mod:", "powered by Hydra", "::\n"):
        assert markup not in page, f"{markup!r} in {prog} --help"
    assert not list(tmp_path.iterdir())  # --help writes nothing (no run folder)
