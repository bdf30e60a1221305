"""The suite's logger: named lightning_parallel, rank-zero functions, levels a user can set (runtime/log.py)."""

import logging

import pytest
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_parallel.runtime import log


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def lines(monkeypatch):
    handler, level = _Lines(), log.logger.level
    log.logger.addHandler(handler)
    log.logger.setLevel(logging.DEBUG)
    yield handler.lines
    log.logger.removeHandler(handler)
    log.logger.setLevel(level)


def test_the_suites_messages_go_through_its_own_logger_at_their_level(lines, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    assert log.logger is logging.getLogger("lightning_parallel")
    log.rank_zero_info("resumed %d batches", 3)
    log.rank_zero_warn("the epoch restarts")
    log.rank_zero_debug("detail")
    assert lines == [("INFO", "resumed 3 batches"), ("WARNING", "the epoch restarts"), ("DEBUG", "detail")]


def test_only_global_rank_zero_logs(lines, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    log.rank_zero_warn("not on rank 1")
    assert lines == [] and log.global_rank() == 1


def test_a_user_silences_the_suites_notes_by_level(lines, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    log.logger.setLevel(logging.WARNING)
    log.rank_zero_info("a note")
    log.rank_zero_warn("a warning")
    assert lines == [("WARNING", "a warning")]
