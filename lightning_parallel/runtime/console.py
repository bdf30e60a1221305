"""Two-column tables on the console, copied into the run's log file."""

from __future__ import annotations

import logging
from typing import Optional

from rich.console import Console
from rich.table import Table


def table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A rich table of ``(what, value)`` rows with a left-aligned title and no header."""
    out = Table(title=title, show_header=False, title_justify="left")
    out.add_column("what", style="bold", no_wrap=True)
    out.add_column("value")
    for key, value in rows:
        out.add_row(key, value)
    return out


def log_to_file(text: str) -> None:
    """Write ``text`` to the run's log file(s) only, not to the console (tables, tracebacks).

    The files are the root logger's ``FileHandler`` s (Hydra's ``train.log``/``rank<k>.log``); without
    any, nothing is written.
    """
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.stream.write(text if text.endswith("\n") else text + "\n")
            handler.flush()


LOG_WIDTH = 140  # columns when the output is no terminal (a pipe, a CI log, a test): as wide as the log file reads


def console_width() -> Optional[int]:
    """None (rich's own detection: the terminal's width) on a terminal, else :data:`LOG_WIDTH`.

    Note:
        Tables drawn 140 wide wrapped every row in a 100-column terminal; without a terminal rich would pick 80,
        which folds the paths in the start-up table of every log.
    """
    return None if Console().is_terminal else LOG_WIDTH


def print_table(title: str, rows: list[tuple[str, str]], console: Optional[Console] = None) -> None:
    """Print a two-column table (rank 0 only: the caller decides); the run's log file gets it too.

    Args:
        title: the table's title.
        rows: ``(what, value)`` pairs.
        console: where to print (a recording console as wide as the terminal, or 140 columns without one).
    """
    console = console or Console(width=console_width(), record=True)
    console.print(table(title, rows))
    if console.record:
        log_to_file(console.export_text())
