"""MkDocs hook: the committed benchmark results join the site, so docs pages link to them as files.

A page links to ``/benchmarks/results/<date>/report.md`` (GitHub reads a leading ``/`` as the
repository's root; ``validation.absolute_links: relative_to_docs`` makes MkDocs check it against the
files below): a moved or deleted result fails the strict build like any other broken link.
"""

from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

FOLDERS = ("benchmarks/results",)


def on_files(files, config):
    root = Path(config.config_file_path).parent
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file():
                file = File(path.relative_to(root).as_posix(), src_dir=str(root), dest_dir=config.site_dir,
                            use_directory_urls=config.use_directory_urls)
                file.inclusion = InclusionLevel.NOT_IN_NAV  # rendered and linkable, not a page of the nav
                files.append(file)
    return files
