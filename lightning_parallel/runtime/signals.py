"""Ctrl-C and SIGTERM for a run: stop every rank at the same step, save, exit within seconds.

The first SIGINT or SIGTERM asks for a stop: the launcher forwards it at once to every local rank
it started, and each rank's :class:`~lightning_parallel.callbacks.graceful_stop.GracefulStop` ends
training at the next optimizer step that all ranks agree on (a one-element all-reduce per step),
writes ``checkpoints/last-stop.ckpt`` (which ``resume=`` and ``ckpt_path=last`` pick up) and exits.
A rank that is not done within the grace period
(``LP_STOP_GRACE_S``, default 30 s; at once when no step has finished yet, since there is
nothing to save) is killed, and so is everything at the second signal. Child ranks die with the
launcher (``PR_SET_PDEATHSIG``), so no rank outlives it, whatever kills it.

Note:
    A Python signal handler runs only when the main thread returns to the interpreter, which a
    rank blocked in a collective does not do. The signal is therefore read from
    ``signal.set_wakeup_fd`` by a watcher thread, which forwards and times the stop even while
    the main thread waits inside gloo. The Python-level handlers do nothing (no
    ``KeyboardInterrupt`` in the middle of a collective, which is what left ranks hanging).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED_EXIT_CODE = 130
_PR_SET_PDEATHSIG = 1


def grace_seconds() -> float:
    """Seconds a rank gets after the first signal to save and exit (``LP_STOP_GRACE_S``, default 30)."""
    return float(os.environ.get("LP_STOP_GRACE_S", "30"))


def _say(message: str) -> None:
    print(f"lp-train: {message}", file=sys.stderr, flush=True)


class Shutdown:
    """The stop state of this process: signals seen, the ranks it started, whether a step has finished.

    Args:
        grace_s: seconds between the first signal and killing what still runs.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.signals = 0
        self.signal_time: Optional[float] = None
        self.children: list[subprocess.Popen] = []
        self.step_finished = False
        self.saved: Optional[str] = None
        self.before_forward: Optional[Any] = None  # called once before the first signal reaches the children

    def on_signal(self, signum: int) -> None:
        """React to one SIGINT/SIGTERM (called by the watcher thread)."""
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals > 1:
            _say(f"second {name}: killing {self._ranks()} now.")
            self.kill_all()
        self.signal_time = time.monotonic()
        self.requested.set()
        if self.before_forward is not None:
            self.before_forward()
        live = [c for c in self.children if c.poll() is None]
        for child in live:
            os.kill(child.pid, signal.SIGINT)  # SIGINT: Lightning's own SIGTERM handler would run a collective
        if not self.step_finished:
            _say(f"{name}: no training step has finished yet, nothing to save: stopping {self._ranks()} now.")
            self.kill_all()
        if self.children or os.environ.get("RANK", "0") == "0":
            _say(f"{name}: stopping {self._ranks()} after the current step; saving checkpoints/last-stop.ckpt "
                 f"(up to {self.grace_s:.0f} s, then they are killed). Press Ctrl-C again to kill them now.")
        threading.Thread(target=self._deadline, daemon=True, name="lp-stop-deadline").start()

    def _ranks(self) -> str:
        return f"all {len(self.children) + 1} local ranks" if self.children else "this rank"

    def _deadline(self) -> None:
        time.sleep(self.grace_s)
        _say(f"not stopped within {self.grace_s:.0f} s: killing {self._ranks()}.")
        self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL every child rank, then leave with exit code 130."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()
        os._exit(INTERRUPTED_EXIT_CODE)


_state: dict[str, Any] = {}


def current() -> Optional[Shutdown]:
    """This process's :class:`Shutdown` (None before :func:`install`)."""
    return _state.get("shutdown")


def stop_requested() -> bool:
    """True once SIGINT/SIGTERM asked this process to stop."""
    shutdown = current()
    return bool(shutdown and shutdown.requested.is_set())


RUN_STOP_FILE = "LP_RUN_STOP_FILE"  # set by the fault-tolerance supervisor for its groups (cli/replica_launch.py)


def run_wide_stop() -> bool:
    """Whether this process's stop is the whole run's: the fault-tolerance supervisor was stopped and wrote its marker
    before forwarding the signal to every replica group (the groups then stop after one step they all agree on). A
    signal to one group alone (a preempted host) stops that group only; the supervisor restarts it and it heals."""
    marker = os.environ.get(RUN_STOP_FILE)
    return bool(marker) and stop_requested() and os.path.exists(marker)


def _do_nothing(signum: int, frame: Any) -> None:
    """The Python-level handler: the watcher thread does the work (see the module note)."""


def take_handlers() -> None:
    """(Re)install the do-nothing handlers in the main thread, e.g. after Lightning replaced SIGTERM's."""
    if current() is not None and threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _do_nothing)


def install(grace_s: Optional[float] = None) -> Shutdown:
    """Route SIGINT/SIGTERM of this process to a :class:`Shutdown` (main thread; once per process).

    Args:
        grace_s: seconds to save and exit after the first signal (default :func:`grace_seconds`).
    """
    if current() is not None:
        return current()
    shutdown = Shutdown(grace_seconds() if grace_s is None else grace_s)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    _state.update(shutdown=shutdown, pipe=(read_fd, write_fd))
    take_handlers()
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 64):
                if signum in STOP_SIGNALS:
                    shutdown.on_signal(signum)

    threading.Thread(target=watch, daemon=True, name="lp-signal-watcher").start()
    return shutdown


def after_fork() -> Shutdown:
    """In a rank forked from the launcher (cli/forked_rank.py): a stop state of its own.

    The inherited one is the launcher's: its children, its watcher thread (not running here) and its wake-up pipe,
    which would carry this rank's signals to the launcher's watcher.
    """
    for fd in _state.pop("pipe", ()):
        os.close(fd)
    _state.clear()
    return install()


def die_with_parent(parent_pid: int) -> None:
    """Make this process receive SIGKILL when its launcher dies (Linux); exit now if it already has.

    Args:
        parent_pid: the launcher's pid (passed in the environment).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(INTERRUPTED_EXIT_CODE)
