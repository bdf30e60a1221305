"""Fault injection for fault-tolerant runs: a rank that dies or hangs at a given step, in its first incarnation only.

Usable in your own tests as in the suite's::

    trainer = Trainer(..., strategy=HybridParallelStrategy(..., fault_tolerance={...}),
                      callbacks=[FaultInjection(fail_at(replica=1, rank=0, step=5))])

A fault fires in the first incarnation of its replica group only (``$TORCHELASTIC_RESTART_COUNT`` under torchrun,
``$LP_FT_INCARNATION`` under :func:`~lightning_parallel.testing.replica_groups.run_replica_groups`), at the start of
the given committed step (``trainer.global_step``), so the restarted group runs on.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

# A cross-group collective that breaks while no group leaves is not injected: torchft 0.2.0 rebuilds its process
# group only when the quorum changes (docs/fault-tolerance.md).
KINDS = ("exit", "hang")


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    Args:
        kind: ``exit`` (the process dies at once, as a lost host would) or ``hang`` (it stops responding and
            stays alive, as a stuck kernel or a deadlock would; its group fails by ``group_timeout``).
        replica: replica group (``$REPLICA_GROUP_ID``).
        rank: rank inside the group.
        step: committed step at whose start it fires.
    """

    kind: str
    replica: int
    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault kind {self.kind!r}: choose one of {', '.join(KINDS)}.")


def fail_at(replica: int, rank: int, step: int) -> Fault:
    """Rank ``rank`` of group ``replica`` exits (code 17, no clean-up) at the start of step ``step``."""
    return Fault("exit", replica, rank, step)


def hang_at(replica: int, rank: int, step: int) -> Fault:
    """Rank ``rank`` of group ``replica`` stops responding (stays alive) at the start of step ``step``."""
    return Fault("hang", replica, rank, step)


def incarnation() -> int:
    """How many times this replica group has been restarted (0: the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("LP_FT_INCARNATION", "0")))


def _parse(spec: str) -> Fault:
    try:
        replica, rank, step = (int(part) for part in str(spec).split(":"))
    except ValueError:
        raise ValueError(f"fail_at entry {spec!r} must read replica:rank:step, e.g. '1:0:5'.") from None
    return fail_at(replica, rank, step)


class FaultInjection(Callback):
    """Fire the given faults in this process when their group, rank and step come.

    Args:
        *faults: from :func:`fail_at`, :func:`hang_at`, :func:`break_collective_at`.
    """

    def __init__(self, *faults: Fault, fail_at: Optional[list[str]] = None) -> None:
        self.faults = faults + tuple(_parse(spec) for spec in (fail_at or []))

    def _due(self, trainer: Any, kinds: tuple[str, ...]) -> list[Fault]:
        if incarnation() != 0:
            return []
        replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
        return [f for f in self.faults if f.kind in kinds and f.replica == replica and f.rank == trainer.global_rank
                and f.step == trainer.global_step]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        for fault in self._due(trainer, KINDS):
            if fault.kind == "exit":
                os._exit(17)
            time.sleep(10**6)


class HoldWhileDegraded(Callback):
    """Slow this group's steps while the quorum lacks groups, so a restarted group can rejoin before the end.

    Tests only: on a few CPU cores a group alone finishes in less time than a restart takes.

    Args:
        seconds: pause per step while degraded.
        budget: most seconds paused in all.
    """

    def __init__(self, seconds: float = 0.5, budget: float = 60.0) -> None:
        self.seconds, self.budget = seconds, budget

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        groups = trainer.strategy.replica_groups
        if 0 < groups.participants < groups.resolved.replicas and self.budget > 0:
            time.sleep(self.seconds)
            self.budget -= self.seconds


class CtrlCAtStep(Callback):
    """Deliver a user's Ctrl-C to ``lp-train`` at the start of a given step of a fresh run (tests only).

    A terminal's Ctrl-C reaches ``lp-train``'s launcher process alone (its ranks run in their own session), and
    global rank 0 runs in that process: so rank 0 signals its own process, and the stop then runs exactly as after
    a key press (:mod:`lightning_parallel.runtime.signals`). A resumed run (``ckpt_path`` set) never fires, so the
    resume command the stop prints, which repeats the run's overrides, runs to its end.

    Args:
        step: the optimizer step at whose start the signal is sent.
        replica: under fault tolerance, the replica group whose rank 0 sends it (``$REPLICA_GROUP_ID``), to the
            supervisor above the groups (``lp-train``'s own process there: the terminal's Ctrl-C reaches it).
    """

    def __init__(self, step: int, replica: Optional[int] = None) -> None:
        self.step, self.replica = step, replica

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0 or trainer.global_step != self.step or trainer.ckpt_path:
            return
        if self.replica is None:
            os.kill(os.getpid(), signal.SIGINT)
        elif int(os.environ.get("REPLICA_GROUP_ID", "-1")) == self.replica and incarnation() == 0:
            os.kill(os.getppid(), signal.SIGINT)
