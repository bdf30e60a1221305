"""The documentation site builds in strict mode, and the README stays a front door whose links resolve.

``mkdocs build --strict`` (mkdocs.yml) fails on a broken link or anchor, a page missing from the nav,
an unresolved cross-reference and an API object mkdocstrings cannot find; a negative control shows
that a broken link and a missing reference do fail it. The docs packages come with the ``test`` and
``docs`` extras.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300

needs_mkdocs = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("mkdocs", "mkdocstrings", "material")),
    reason="the docs packages are not installed: pip install -e '.[docs]' (mkdocs, mkdocs-material, mkdocstrings)",
)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
@needs_mkdocs
def test_site_builds_in_strict_mode(tmp_path):
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    reference = (tmp_path / "site" / "reference" / "strategies.html").read_text()
    assert 'id="lightning_parallel.strategies.HybridParallelStrategy"' in reference
    assert (tmp_path / "site" / "benchmarks" / "results" / "2026-12-02" / "step_time.png").is_file()
    pages = sorted((tmp_path / "site").rglob("*.html"))
    unstyled = [p.name for p in pages if "stylesheets/extra.css" not in p.read_text()]
    assert len(pages) > 20 and unstyled == []  # every page carries the wrapping rules


@pytest.mark.slow
@needs_mkdocs
def test_a_broken_link_or_a_missing_reference_fails_the_build(tmp_path):
    """Negative control: a two-page site with the project's settings (mkdocs.yml up to its nav: strict, hooks,
    mkdocstrings) builds; one broken link and one unresolved API reference added to it fail the build."""
    copy = tmp_path / "repo"
    (copy / "docs").mkdir(parents=True)
    shutil.copytree(ROOT / "docs" / "_hooks", copy / "docs" / "_hooks")
    shutil.copytree(ROOT / "docs" / "stylesheets", copy / "docs" / "stylesheets")
    settings = (ROOT / "mkdocs.yml").read_text()
    (copy / "mkdocs.yml").write_text(settings[:settings.index("\nnav:")] + "\nnav:\n  - index.md\n  - api.md\n")
    (copy / "lightning_parallel").symlink_to(ROOT / "lightning_parallel", target_is_directory=True)
    (copy / "docs" / "api.md").write_text("# API\n\n::: lightning_parallel.layout.ParallelLayout\n")
    index = copy / "docs" / "index.md"
    index.write_text("# Home\n\n[The API](api.md), [`ParallelLayout`][lightning_parallel.layout.ParallelLayout]\n")
    built = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    with index.open("a") as page:
        page.write("\n[gone](no-such-page.md) and [`Gone`][lightning_parallel.NoSuchStrategy]\n")
    result = _build(copy / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "no-such-page.md" in output and "lightning_parallel.NoSuchStrategy" in output


WRAPPED = ("bash", "console", "shell", "python", "yaml")  # docs/stylesheets/extra.css wraps these blocks
PLAIN_WIDTH = 120  # characters of an unwrapped block that fit the content column (the arithmetic in extra.css)


def test_docs_pages_are_readable_without_scrolling_sideways():
    """The site's stylesheet wraps commands, code and table cells; blocks that keep their columns (trees, charts,
    console tables: unlabelled or ``text``) fit the widened column; a code block in another language would neither
    wrap nor be held to the width, so there is none."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    assert "stylesheets/extra.css" in (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"\.md-grid\s*\{\s*max-width:\s*100rem", css)
    for language in WRAPPED:
        assert f".md-typeset .language-{language} pre > code" in css, language
    assert "table:not([class]) code" in css and "white-space: pre-wrap" in css
    too_wide, unknown = [], []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            language = block.group(1)
            if language in WRAPPED or language == "mermaid":
                continue
            if language not in ("", "text"):
                unknown.append(f"{page.relative_to(ROOT)}: ```{language}")
            too_wide += [f"{page.relative_to(ROOT)}: {len(line)} characters: {line[:60]}..."
                         for line in block.group(2).splitlines() if len(line) > PLAIN_WIDTH]
    assert unknown == [] and too_wide == [], unknown + too_wide


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines; move sections into docs/ (at most {MAX_README_LINES})"
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links(text: str) -> list[str]:
    """Targets of Markdown links and images, outside fenced code blocks and code spans."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


def test_every_relative_link_in_the_readme_resolves():
    broken = []
    links = [link for link in _links(README.read_text()) if not re.match(r"[a-z]+:", link)]
    assert len(links) > 20
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md":
            text = re.sub(r"^```.*?^```", "", target.read_text(), flags=re.M | re.S)
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
            if anchor not in headings:
                broken.append(f"{link}: no heading #{anchor} in {path}")
    assert broken == []


def _layout_sections(page: str) -> dict[str, str]:
    """docs/layout.md's code block as ``{top-level entry: its text}`` (an entry starts at column 2: ``layout/``,
    ``protocol.py``; its description runs until the next entry)."""
    sections: dict[str, str] = {}
    current = None
    for line in page.splitlines():
        entry = re.match(r"^  (\S+)", line)
        if entry:
            current = entry.group(1)
            sections[current] = ""
        if current is not None:
            sections[current] += line + "\n"
    return sections


def test_source_layout_page_names_every_module_under_its_package():
    """docs/layout.md lists every module of the package, each in the entry of its top-level package (a nested
    package's modules with the nested package named there too): the page follows the tree as it moves."""
    sections = _layout_sections((ROOT / "docs" / "layout.md").read_text())
    package = ROOT / "lightning_parallel"
    missing = []
    for module in sorted(package.rglob("*.py")):
        parts = module.relative_to(package).parts
        if len(parts) == 1:
            if parts[0] not in sections:
                missing.append(parts[0])
            continue
        text = sections.get(f"{parts[0]}/", "")
        wanted = [f"{folder}/" for folder in parts[1:-1]] + ([] if parts[-1] == "__init__.py" else [parts[-1]])
        missing += [f"{'/'.join(parts)} ({name})" for name in wanted
                    if not re.search(rf"(^|[\s(/,]){re.escape(name)}", text, flags=re.M)]
        if not text:
            missing.append(f"{parts[0]}/ (no entry)")
    assert missing == [], sorted(set(missing))


def test_every_repository_path_the_docs_name_exists():
    """`lightning_parallel/...`, `tests/...`, `benchmarks/...`, `conf/...`, `examples/...` in code spans of the
    README and docs/ name files that exist (the package moves; the docs follow)."""
    installed_only = {"lightning_parallel/conf"}  # where the wheel puts conf/
    span = re.compile(r"`((?:lightning_parallel|tests|benchmarks|conf|examples)/[\w/.\-]*)`")
    missing = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for path in span.findall(page.read_text()):
            if path not in installed_only and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert missing == []


# A sentence that promises equal results across a resume, a load or a conversion.
PROMISE = re.compile(r"uninterrupted|bit-identical|round[- ]trip|resum\w*[^.]{0,120}(same|equal|exact)"
                     r"|(same|equal)[^.]{0,80}after (a |the )?(resume|load|conversion)", re.IGNORECASE)


def test_every_promise_of_equal_results_after_a_resume_load_or_conversion_names_its_test():
    """Each paragraph, list item or table row of the README and docs/ that promises the same losses or weights after a
    resume, a load or a conversion names the test that holds it (`tests/...py`, which exists)."""
    unheld = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for part in re.split(r"\n\s*\n|\n- |\n\* |\n\| ", page.read_text()):
            tests = re.findall(r"tests/[\w/]+\.py", part)
            if PROMISE.search(part) and (not tests or not all((ROOT / t).is_file() for t in tests)):
                unheld.append(f"{page.relative_to(ROOT)}: {part.strip()[:160]!r}")
    assert unheld == [], "\n".join(unheld)
