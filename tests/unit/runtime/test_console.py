"""Tables as wide as the terminal, 140 columns without one (runtime/console.py)."""

import io
import re
import sys

from lightning_parallel.runtime import console


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_riches_own_width_and_a_pipe_the_log_width(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert console.console_width() == console.LOG_WIDTH
    monkeypatch.setattr(sys, "stdout", _Terminal())
    monkeypatch.delenv("TERM", raising=False)
    assert console.console_width() is None


def test_a_table_fits_a_100_column_terminal(monkeypatch):
    out = _Terminal()
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "stdout", out)
    console.print_table("lightning_parallel: run", [("output dir", "outputs/2026-12-05/" + "x" * 150)])
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # a terminal gets colours
    assert max(len(line) for line in text.splitlines()) <= 100
