"""Run a function in N CPU processes joined by gloo, as a test or a script would.

Every distributed test of the suite goes through :func:`run_processes`: it picks a free
port (never a fixed one), gives each rank the environment ``torchrun`` would
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus
``OMP_NUM_THREADS=1``, and waits with a deadline. A rank that raises, dies or hangs
ends the whole run: all ranks are killed and the error shows the failing rank's
traceback, so a broken collective never hangs the test session.

Because ``LOCAL_RANK`` is set, Lightning treats the processes as launched externally,
so the function may build a ``Trainer(devices=N, ...)`` and call ``fit`` directly.

Ranks start from a fork server that has imported torch, Lightning and this package once
(``set_forkserver_preload``): with ``spawn`` every rank of every launch re-imported them, which
cost seconds per rank and dominated short tests. The fork server is single-threaded when it
forks (it only imports and waits), so forking it is safe where forking the test process, whose
torch may have started threads, is not. Each rank still starts as ``spawn`` would have started
it: with the parent's current environment and working directory and fresh random seeds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Optional

from lightning_parallel.runtime.ports import free_port

# What every rank imports anyway; the fork server imports it once for all launches of a session
# (and the commands the integration tests run: lp-train's module, Hydra with it).
# Not deepspeed: its import asks torch.cuda for the device count, and a process that has touched
# CUDA cannot hand it on to forked children (checked: these never touch torch.cuda).
PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning_parallel", "lightning_parallel.cli.train")
_START_METHOD = "forkserver"  # "spawn" works too, re-importing everything in every rank (seconds per rank)


class DistributedRunError(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    args: tuple,
    kwargs: dict,
    results: "mp.Queue[tuple[int, bool, Any]]",
    parent_environ: Optional[dict[str, str]] = None,
) -> None:
    if parent_environ is not None:
        # The fork server's environment is the parent's at the time the server started; a rank gets
        # the parent's environment of now, as a spawned process would.
        os.environ.clear()
        os.environ.update(parent_environ)
    os.environ.update(env)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import numpy
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # Forked ranks would share the fork server's generator states (Python's own `random` reseeds
    # itself after a fork); a spawned process starts from fresh entropy, so do these.
    torch.seed()
    numpy.random.seed()
    try:
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle, not the queue's: torch would share tensors through file descriptors
        # that vanish when this process exits before the parent reads them.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: Optional[dict[str, str]] = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` fresh processes.

    Args:
        fn: a module-level (picklable) function; it may call
            ``torch.distributed.init_process_group("gloo")`` or build a Lightning Trainer.
        world_size: number of processes.
        *args: positional arguments passed to every rank.
        timeout: seconds for the whole run; on expiry all ranks are killed.
        env: extra environment variables for every rank.
        **kwargs: keyword arguments passed to every rank.

    Returns:
        The return values, indexed by rank (they must be picklable).

    Raises:
        DistributedRunError: a rank raised (its traceback is in the message), exited
            without reporting, or the deadline passed.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    procs, results = start_ranks(fn, world_size, args, kwargs, env)
    outputs: dict[int, Any] = {}
    try:
        _collect(procs, results, outputs, timeout)
    finally:
        stop_ranks(procs, finished=len(outputs) == world_size)
    return [outputs[rank] for rank in range(world_size)]


def start_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, env: Optional[dict[str, str]]
) -> tuple[list[Any], mp.Queue]:
    """Start the ranks on a free port; each reports ``(rank, ok, pickled value or traceback)`` on the queue."""
    ctx = mp.get_context(_START_METHOD)  # never plain "fork": torch may have started threads in this process
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts (the first launch)
    results: mp.Queue = ctx.Queue()
    port = free_port()
    rank_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, rank_env, args, kwargs, results, dict(os.environ)),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    return procs, results


def _collect(procs: list[Any], results: mp.Queue, outputs: dict[int, Any], timeout: float) -> None:
    """Fill ``outputs`` with every rank's value, or raise on the first failure, death or the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise DistributedRunError(f"Timed out after {timeout:.0f}s waiting for ranks {missing}.")
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                raise DistributedRunError(
                    f"Rank {dead[0]} exited with code {procs[dead[0]].exitcode} without reporting a result."
                ) from None
            continue
        if not ok:
            raise DistributedRunError(f"Rank {rank} of {world_size} failed:\n{value}")
        outputs[rank] = pickle.loads(value)


def stop_ranks(procs: list[Any], finished: bool) -> None:
    """Join the ranks (briefly when the run failed) and kill any still alive."""
    for proc in procs:
        proc.join(timeout=10 if finished else 0.1)
        if proc.is_alive():
            proc.kill()
            proc.join()
