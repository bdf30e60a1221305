"""Run several replica groups of a fault-tolerant job as CPU processes, restarting a group that fails.

What ``torchrun --max-restarts`` does for each group of a cluster job, in one call for tests: a lighthouse in this
process, each group its own gloo world on its own port (its ranks get ``$REPLICA_GROUP_ID``,
``$NUM_REPLICA_GROUPS``, ``$TORCHFT_LIGHTHOUSE`` and ``$LP_FT_INCARNATION``), and a group whose rank raises or dies
is stopped as a whole and started again while the others go on.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_parallel.fault_tolerance.lighthouse import start_lighthouse
from lightning_parallel.fault_tolerance.replicas import ft_environment
from lightning_parallel.testing.processes import DistributedRunError, start_ranks, stop_ranks


@dataclass
class _Group:
    index: int
    procs: list[Any] = field(default_factory=list)
    results: Any = None
    outputs: dict[int, Any] = field(default_factory=dict)
    incarnation: int = 0
    failures: list[str] = field(default_factory=list)
    relaunch_at: Optional[float] = None


@dataclass(frozen=True)
class ReplicaGroupsResult:
    """What :func:`run_replica_groups` returns.

    Attributes:
        outputs: per group, the return values of its ranks in its last incarnation.
        restarts: per group, how many times it was restarted.
        failures: per group, why each earlier incarnation ended.
    """

    outputs: list[list[Any]]
    restarts: list[int]
    failures: list[list[str]]


def run_replica_groups(fn: Callable[..., Any], groups: int, group_size: int, *args: Any, restarts: int = 1,
                       timeout: float = 300.0, env: Optional[dict[str, str]] = None, join_timeout_ms: int = 10000,
                       heartbeat_timeout_ms: int = 2000, restart_delay: float = 0.0,
                       watch: Optional[Callable[[Any], None]] = None, **kwargs: Any) -> ReplicaGroupsResult:
    """Call ``fn(rank, group_size, *args, **kwargs)`` on ``group_size`` processes per group, ``groups`` groups.

    Args:
        fn: a module-level function (as for :func:`~lightning_parallel.testing.run_processes`).
        groups: replica groups.
        group_size: processes per group (its pipeline x tensor x data layout).
        *args: passed to every rank.
        restarts: restarts allowed per group.
        timeout: seconds for the whole run.
        env: extra environment for every rank.
        join_timeout_ms: the lighthouse's wait for groups that heartbeat but have not asked to join.
        heartbeat_timeout_ms: how long a silent group counts as alive.
        restart_delay: seconds between a group's failure and its restart (longer than ``heartbeat_timeout_ms``:
            the others notice the loss and train on without it first).
        watch: called with the lighthouse server on every supervision tick, in this process (a fault trial shuts
            the lighthouse down when the run reaches a step: ``benchmarks/fault_replicas.py``).
        **kwargs: passed to every rank.

    Raises:
        DistributedRunError: a group failed more than ``restarts`` times, or the deadline passed.
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and vote at info
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=heartbeat_timeout_ms)
    state = [_Group(g) for g in range(groups)]
    deadline = time.monotonic() + timeout

    def launch(group: _Group) -> None:
        group_env = {**(env or {}), **ft_environment(group.index, groups, lighthouse.address()),
                     "LP_FT_INCARNATION": str(group.incarnation)}
        group.procs, group.results = start_ranks(fn, group_size, args, kwargs, group_env)
        group.outputs = {}

    try:
        for group in state:
            launch(group)
        _supervise(state, launch, group_size, restarts, restart_delay, deadline,
                   (lambda: watch(lighthouse)) if watch else (lambda: None))
    finally:
        for group in state:
            stop_ranks(group.procs, finished=len(group.outputs) == group_size)
        lighthouse.shutdown()
    return ReplicaGroupsResult([[g.outputs[r] for r in range(group_size)] for g in state],
                               [g.incarnation for g in state], [g.failures for g in state])


def _supervise(state: list[_Group], launch: Callable[[_Group], None], group_size: int, restarts: int,
               restart_delay: float, deadline: float, tick: Callable[[], None]) -> None:
    """Collect every group's results; stop and (after ``restart_delay``) restart a group that fails."""
    while any(len(g.outputs) < group_size for g in state):
        tick()
        if time.monotonic() > deadline:
            raise DistributedRunError("replica groups timed out: "
                                      f"{[(g.index, sorted(g.outputs)) for g in state]}")
        for group in state:
            if group.relaunch_at is not None:
                if time.monotonic() >= group.relaunch_at:
                    group.relaunch_at = None
                    launch(group)
                continue
            failure = _poll(group, group_size)
            if failure is None:
                continue
            group.failures.append(failure)
            stop_ranks(group.procs, finished=False)
            if group.incarnation >= restarts:
                raise DistributedRunError(f"replica group {group.index} failed {len(group.failures)} times; "
                                          f"last:\n{failure}")
            group.incarnation += 1
            group.relaunch_at = time.monotonic() + restart_delay


def _poll(group: _Group, group_size: int) -> Optional[str]:
    """Collect what the group reported; a failure's description, or None while it is healthy."""
    if len(group.outputs) == group_size:
        return None
    try:
        rank, ok, value = group.results.get(timeout=0.05)
    except queue.Empty:
        dead = [r for r, p in enumerate(group.procs) if p.exitcode not in (None, 0) and r not in group.outputs]
        return f"rank {dead[0]} exited with code {group.procs[dead[0]].exitcode}" if dead else None
    if not ok:
        return f"rank {rank} raised:\n{value}"
    group.outputs[rank] = pickle.loads(value)
    return None
