"""The package's import rules (README "Architecture"), checked on the source: who may import whom."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_parallel"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


# folder -> module prefixes it must never import
FORBIDDEN = {
    PACKAGE / "parallel": ("lightning", "lightning_parallel.strategies", "lightning_parallel.cli.train",
                           "lightning_parallel.checkpoints", "lightning_parallel.callbacks"),
    PACKAGE / "checkpoints": ("lightning.pytorch.trainer", "lightning.pytorch.Trainer", "lightning_parallel.strategies",
                              "lightning_parallel.cli.train"),
    PACKAGE / "adapters": ("lightning", "lightning_parallel.strategies", "lightning_parallel.cli.train",
                           "lightning_parallel.checkpoints", "lightning_parallel.callbacks"),
    ROOT / "examples": ("lightning_parallel.strategies", "lightning_parallel.parallel"),
    PACKAGE / "planner": ("lightning", "lightning_parallel.strategies", "lightning_parallel.cli.train",
                          "lightning_parallel.checkpoints", "lightning_parallel.callbacks"),
}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN), ids=lambda p: str(p.relative_to(ROOT)))
def test_forbidden_import_directions_never_appear(folder):
    bad = []
    for path in _files(folder):
        for name in _imports(path):
            if any(name == prefix or name.startswith(prefix + ".") for prefix in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_private_names_of_other_packages_are_imported_only_by_the_compat_module():
    bad = []
    for path in _files(PACKAGE):
        if path.name == "_compat.py":
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "lightning_parallel" and any(p.startswith("_") and not p.startswith("__") for p in parts):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert bad == []


def test_modules_and_functions_stay_small():
    """No module over 400 lines and no function over 50 (docstring included) under lightning_parallel/."""
    too_long = []
    for path in _files(PACKAGE):
        source = path.read_text()
        if source.count("\n") > 400:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 50:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert too_long == []
