"""lp-train's replica-group supervisor restarts a failed group while the others train, and not once one finished."""

from __future__ import annotations

from lightning_parallel.cli.replica_launch import _GroupProcess, _watch


class _Exited:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


def test_a_group_failing_after_another_finished_is_not_restarted() -> None:
    started = []
    groups = [_GroupProcess(0, _Exited(0)), _GroupProcess(1, _Exited(1))]
    _watch(groups, max_restarts=3, start=started.append)
    assert started == [] and groups[1].restarts == 0


def test_a_failed_group_is_restarted_while_the_others_train(monkeypatch) -> None:
    monkeypatch.setattr("lightning_parallel.cli.replica_launch.time.sleep", lambda s: None)
    clock = iter(range(0, 10**6, 10))
    monkeypatch.setattr("lightning_parallel.cli.replica_launch.time.monotonic", lambda: next(clock))
    running, started = _Exited(None), []

    def start(group):
        started.append(group.index)
        group.process = _Exited(0)
        running.code = 0  # the healthy group finishes after the restart

    _watch([_GroupProcess(0, running), _GroupProcess(1, _Exited(1))], max_restarts=3, start=start)
    assert started == [1]
