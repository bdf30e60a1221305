"""The package's import rules and size limits (docs/architecture.md), checked statically on the source.

Pure ``ast`` analysis: nothing under test is imported, so the file runs in a fraction of a second.
An import counts wherever it sits (inside a function too). Imports under ``if TYPE_CHECKING:`` never run:
the direction and private-name rules exempt them, the circle rule counts them (an annotation is a dependency
too, and a circle through one is the same tangle to a reader). Relative imports are resolved to absolute
names, and ``from pkg import name`` counts as importing ``pkg.name`` as well as ``pkg``, so
``from lightning_parallel import cli`` is seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_parallel"
EXAMPLES = ROOT / "examples"

MAX_TOP_LEVEL_MODULES = 6
MAX_MODULE_LINES = 350
# Modules allowed over the limit while a change brings them under; an entry under the limit (or gone) fails the
# test, so the list cannot outlive the fix. Empty: every module is under it.
OVER_THE_LINE_LIMIT: set[str] = set()
MAX_FUNCTION_LINES = 50


@dataclass(frozen=True)
class Import:
    """One import statement (one per alias of `import a, b`), its targets as absolute dotted names."""

    path: Path
    line: int
    names: tuple[str, ...]  # candidates for matching: the module, then each `module.name` of a `from` import
    module_level: bool  # runs when the module is imported (not inside a function)
    type_checking: bool = False  # under `if TYPE_CHECKING:`: never runs, seen by type checkers only

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class _Collector(ast.NodeVisitor):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.depth = 0  # function nesting
        self.type_checking = False  # inside the body of `if TYPE_CHECKING:`
        self.found: list[Import] = []

    def _add(self, node: ast.stmt, names: tuple[str, ...]) -> None:
        self.found.append(Import(self.path, node.lineno, names, self.depth == 0, self.type_checking))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, (alias.name,))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _absolute(self.path, node)
        self._add(node, (module, *(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self.type_checking = self.type_checking, True
        for statement in node.body:
            self.visit(statement)
        self.type_checking = outer
        for statement in node.orelse:  # the `else:` of `if TYPE_CHECKING:` does run
            self.visit(statement)

    def _visit_function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function


def _collect(path: Path, source: str) -> tuple[Import, ...]:
    collector = _Collector(path)
    collector.visit(ast.parse(source, filename=str(path)))
    return tuple(collector.found)


@cache
def _all_imports(path: Path) -> tuple[Import, ...]:
    """Every import of ``path``, those under ``if TYPE_CHECKING:`` included (the circle rule)."""
    return _collect(path, path.read_text())


def _imports(path: Path) -> tuple[Import, ...]:
    """The imports of ``path`` that run (the direction and private-name rules)."""
    return tuple(found for found in _all_imports(path) if not found.type_checking)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_import_collector_resolves_what_the_rules_rely_on():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from lightning_parallel import cli\n"
        "from . import sibling\n"
        "from ..adapters import hf\n"
        "if TYPE_CHECKING:\n"
        "    import lightning.pytorch\n"
        "else:\n"
        "    import json\n"
        "def f():\n"
        "    from lightning_parallel.parallel import compose\n"
    )
    found = _collect(PACKAGE / "parallel" / "fake.py", source)
    module_level = {name: statement.module_level for statement in found for name in statement.names}
    type_checking = {name: statement.type_checking for statement in found for name in statement.names}
    assert module_level["lightning_parallel.cli"] is True
    assert module_level["lightning_parallel.parallel.sibling"] is True
    assert module_level["lightning_parallel.adapters.hf"] is True
    assert module_level["json"] is True and type_checking["json"] is False
    assert module_level["lightning_parallel.parallel.compose"] is False
    assert type_checking["lightning.pytorch"] is True and type_checking["lightning_parallel.cli"] is False


# --- 1. import directions ----------------------------------------------------------------

TRAINER = ("lightning.pytorch", "pytorch_lightning")


@dataclass(frozen=True)
class Rule:
    id: str
    sources: tuple[Path, ...]  # folders or single files the rule covers
    forbidden: tuple[str, ...]  # module prefixes they must never import
    exempt: tuple[Path, ...] = ()

    def files(self) -> list[Path]:
        files = [f for s in self.sources for f in (_files(s) if s.is_dir() else [s])]
        return [f for f in files if not any(f == e or e in f.parents for e in self.exempt)]


RULES = [
    Rule(
        "parallel-planner-checkpoints-never-import-strategies-cli-or-the-trainer",
        (PACKAGE / "parallel", PACKAGE / "planner", PACKAGE / "checkpoints"),
        ("lightning_parallel.strategies", "lightning_parallel.cli", *TRAINER),
    ),
    Rule(
        "parallel-and-protocol-never-import-adapters",
        (PACKAGE / "parallel", PACKAGE / "protocol.py"),
        ("lightning_parallel.adapters",),
    ),
    Rule("only-cli-imports-cli", (PACKAGE,), ("lightning_parallel.cli",), exempt=(PACKAGE / "cli",)),
    Rule(
        "examples-never-import-strategies-or-parallel",
        (EXAMPLES,),
        ("lightning_parallel.strategies", "lightning_parallel.parallel"),
    ),
    # Engines and adapters stay free of Lightning itself and of the layers built on them.
    Rule(
        "parallel-planner-adapters-never-import-lightning-checkpoints-or-callbacks",
        (PACKAGE / "parallel", PACKAGE / "planner", PACKAGE / "adapters"),
        (
            "lightning",
            "lightning_parallel.strategies",
            "lightning_parallel.checkpoints",
            "lightning_parallel.callbacks",
        ),
    ),
]


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.id)
def test_import_directions(rule):
    offenders = []
    for path in rule.files():
        for found in _imports(path):
            hits = [name for name in found.names if any(_within(name, prefix) for prefix in rule.forbidden)]
            if hits:
                offenders.append(f"{found.where()} imports {hits[0]}")
    assert offenders == [], f"{rule.id}: " + "; ".join(offenders)


def test_private_names_of_other_packages_are_imported_only_by_the_compat_package():
    offenders = []
    for path in _files(PACKAGE):
        if PACKAGE / "_compat" in path.parents:  # the one door (a module per package it reaches into)
            continue
        for found in _imports(path):
            for name in found.names:
                parts = name.split(".")
                private = any(part.startswith("_") and not part.startswith("__") for part in parts)
                if private and parts[0] != "lightning_parallel":
                    offenders.append(f"{found.where()} imports {name}")
    assert offenders == [], "; ".join(offenders)


# --- 2. no import cycles -----------------------------------------------------------------


# Circles in files another change of issue 40 is rewriting (layout/ gains the one mesh owner there): each entry
# must still be a circle, so the list cannot outlive the fix.
KNOWN_CYCLES: list[set[str]] = []


def _package_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere: at module level, inside functions (they run on the first
    call, and a circle through one is still a circle) and under ``if TYPE_CHECKING:``."""
    modules = {_module_name(path): path for path in _files(PACKAGE)}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for found in _all_imports(path):
            module, *imported = found.names
            # `from pkg import mod` imports pkg.mod; `from pkg import function` imports pkg
            targets = {t if t in modules else module for t in imported} or {module}
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_one_cycle(graph, set(component)) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete path start -> ... -> start inside one strongly connected component."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # unreachable for a real component


def test_no_import_cycles_between_package_modules():
    """Functions' and ``TYPE_CHECKING`` imports count: the circle protocol.py -> parallel/adapter.py (inside a
    function) and parallel/options <-> parallel/precision (an annotation) were both invisible to a test that
    counted module-level imports only."""
    cycles = _cycles(_package_graph())
    new = [cycle for cycle in cycles if set(cycle) not in KNOWN_CYCLES]
    assert new == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in new)
    gone = [known for known in KNOWN_CYCLES if known not in [set(cycle) for cycle in cycles]]
    assert gone == [], f"no longer circles, remove them from KNOWN_CYCLES: {gone}"


def test_the_package_graph_counts_imports_inside_functions_and_for_type_checking():
    graph = _package_graph()
    # cli/train.py imports cli/launch.py inside its functions only; parallel/precision.py reads ParallelOptions
    # under TYPE_CHECKING only: both edges are in the graph. The protocol imports nothing of the suite.
    assert "lightning_parallel.cli.launch" in graph["lightning_parallel.cli.train"]
    assert "lightning_parallel.parallel.options" in graph["lightning_parallel.parallel.precision"]
    assert graph["lightning_parallel.protocol"] == set()


def test_cycle_finder_reports_the_modules_of_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


# --- 3. sizes ------------------------------------------------------------------------------


def test_few_top_level_modules():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, (
        f"{len(modules)} top-level modules (at most {MAX_TOP_LEVEL_MODULES}): {modules}"
    )


def test_no_module_over_the_line_limit():
    offenders, stale = [], []
    for path in _files(PACKAGE):
        lines, name = len(path.read_text().splitlines()), path.relative_to(ROOT).as_posix()
        if lines > MAX_MODULE_LINES and name not in OVER_THE_LINE_LIMIT:
            offenders.append(f"{name}: {lines} lines")
        elif lines <= MAX_MODULE_LINES and name in OVER_THE_LINE_LIMIT:
            stale.append(name)
    stale += [name for name in OVER_THE_LINE_LIMIT if not (ROOT / name).exists()]
    assert offenders == [], f"modules over {MAX_MODULE_LINES} lines: " + "; ".join(offenders)
    assert stale == [], f"under {MAX_MODULE_LINES} lines now (or gone), remove them from OVER_THE_LINE_LIMIT: {stale}"


def test_no_function_over_the_line_limit():
    """Methods and nested functions count in their own right; decorators do not count, the docstring does."""
    offenders = []
    for path in _files(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert offenders == [], f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(offenders)


def test_the_wheel_lists_every_subpackage_of_the_suite():
    """pyproject.toml names packages one by one (conf/ and examples/ are mapped in), so a new subpackage left out
    of the list installs nowhere; the wheel test finds that in minutes, this in milliseconds."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "lightning_parallel").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert sorted(found - listed) == []
