"""Start a local rank by forking the launcher after its imports and checks, instead of a new interpreter.

A rank started as ``python -m lightning_parallel.cli.train`` imports torch, Lightning (torchmetrics pulls in
transformers and scipy) and the suite again, composes the Hydra config again and repeats the launcher's preflight:
about 5 s of CPU per rank that, on a laptop or CI machine with few cores, the ranks pay one after another. A forked
rank starts with all of that done: the launcher has imported everything, composed and checked the job, read the
start checkpoint and claimed the run folder; the child only becomes rank k and trains.

Forking is safe here because nothing at the fork holds a device or a process group: the launcher forks before
``trainer.fit`` creates either, from its main thread, and only where CUDA cannot be touched (CPU runs: see
:func:`start_method`). Lightning's own ``ddp_fork`` strategy rests on the same conditions. ``LP_START_METHOD=spawn``
goes back to a new interpreter per rank.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

START_METHOD_ENV = "LP_START_METHOD"


def start_method(accelerator: Any) -> str:
    """``"fork"`` or ``"spawn"``: how :func:`lightning_parallel.cli.launch.local_ranks` starts ranks 1..N-1.

    Fork on Linux when the run is on CPU: ``trainer.accelerator=cpu``, or ``auto`` on a machine without CUDA devices
    (counted through NVML, which does not initialise CUDA in the launcher). A CUDA run spawns: a CUDA context does
    not survive a fork, and the launcher may have touched CUDA in its checks.

    Args:
        accelerator: ``trainer.accelerator`` from the config.

    Raises:
        ValueError: ``LP_START_METHOD`` is set to something other than ``fork`` or ``spawn``.
    """
    chosen = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if chosen and chosen not in ("fork", "spawn"):
        raise ValueError(f"{START_METHOD_ENV}={chosen!r}: use fork (CPU runs, the default there) or spawn")
    if chosen == "spawn" or not sys.platform.startswith("linux"):
        return "spawn"
    import torch

    if torch.cuda.is_initialized():
        return "spawn"
    if chosen == "fork" or str(accelerator).lower() == "cpu":
        return "fork"
    if str(accelerator).lower() != "auto":
        return "spawn"
    from lightning.fabric.accelerators.cuda import num_cuda_devices

    return "fork" if num_cuda_devices() == 0 else "spawn"


class ForkedRank:
    """A forked child rank with the part of :class:`subprocess.Popen`'s interface the launcher uses.

    Reaping is locked: the launcher's watcher thread and its main thread both poll and wait.

    Args:
        pid: the child's process id.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()

    def poll(self) -> Optional[int]:
        """The exit code once the child has ended (negative: the signal that killed it), else None."""
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (cannot happen through this object): call it gone
                    self.returncode = -9
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the child; ``subprocess.TimeoutExpired`` after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child (nothing when it has already ended)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def _log_to_rank_file(run_dir: Path, rank: int) -> None:
    """Point the inherited log file handlers (the launcher's ``train.log``) at this rank's ``rank<k>.log``, the file a
    spawned rank writes (Hydra names it after ``hydra.job.name=rank<k>``)."""
    replaced: dict[int, logging.FileHandler] = {}
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for logger in loggers:
        for handler in list(logger.handlers):
            if not isinstance(handler, logging.FileHandler):
                continue
            if id(handler) not in replaced:
                own = logging.FileHandler(run_dir / f"rank{rank}.log", mode="a")
                own.setFormatter(handler.formatter)
                own.setLevel(handler.level)
                replaced[id(handler)] = own
            logger.removeHandler(handler)  # not closed: the file object is the launcher's too
            logger.addHandler(replaced[id(handler)])


def exit_status(done: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` asks for, as the interpreter computes it (None 0, a message 1).

    Args:
        done: the raised ``SystemExit``.
    """
    return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)


def fork_rank(rank: int, env: dict[str, str], run_dir: Path, body: Callable[[], int]) -> ForkedRank:
    """Fork local rank ``rank``; in the child set its environment, run ``body`` and exit with its code.

    The child never returns into the launcher's stack (a Hydra multirun would run the next job there): whatever
    happens, it flushes its output and exits without unwinding.

    Args:
        rank: the local rank the child becomes.
        env: the child's whole environment (``RANK``, ``LOCAL_RANK``, ``MASTER_PORT``, ``OMP_NUM_THREADS``, ...).
        run_dir: the run's folder (the child's log goes to ``rank<k>.log`` there).
        body: what the rank runs; returns its exit code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        _become_rank(rank, env, run_dir)
        code = body()
    except SystemExit as done:
        code = exit_status(done)
    except BaseException as error:  # noqa: BLE001 - the child must not unwind into the launcher's frames
        print(f"lp-train: rank {rank} failed before its job could report it: {error!r}", file=sys.stderr, flush=True)
        code = 1
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become_rank(rank: int, env: dict[str, str], run_dir: Path) -> None:
    """In the forked child: own session, its environment, its threads, signals and log file."""
    import torch

    from lightning_parallel.runtime import signals

    os.setsid()  # as a spawned rank: a terminal's Ctrl-C reaches the launcher only, which forwards it once
    os.environ.clear()
    os.environ.update(env)
    signals.after_fork()
    signals.die_with_parent(int(env["LP_PARENT_PID"]))
    # OMP_NUM_THREADS is read when torch loads, in the launcher: the rank's share is set here instead.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    _log_to_rank_file(run_dir, rank)
