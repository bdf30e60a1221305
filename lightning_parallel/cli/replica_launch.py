"""``lp-train`` with ``strategy.fault_tolerance`` on one node: a lighthouse, and each replica group its own
``lp-train`` (with its share of ``trainer.devices``), restarted when it fails while the others train on.

What a cluster does with ``torchft_lighthouse`` and one ``torchrun --max-restarts`` per group
(docs/fault-tolerance.md), in one command. Each group writes its own run folder, ``<run dir>/group<g>``, and
each restart a new one, ``group<g>-restart<k>`` (a run folder holds one run; the restart heals from the other
groups, not from a checkpoint).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.preflight import ConfigError
from lightning_parallel.fault_tolerance.options import ENV_REPLICA_GROUP, FaultTolerance
from lightning_parallel.runtime import signals


def supervises(cfg: DictConfig) -> bool:
    """True when this ``lp-train`` should start the replica groups rather than train (a fault-tolerant run that
    no launcher has split into groups yet)."""
    from lightning_parallel.cli.launch import launched_externally

    strategy = cfg.get("strategy")
    node = strategy.get("fault_tolerance") if isinstance(strategy, DictConfig) else None  # strategy=single: "auto"
    return bool(node) and ENV_REPLICA_GROUP not in os.environ and not launched_externally()


@dataclass
class _GroupProcess:
    index: int
    process: Optional[subprocess.Popen] = None
    restarts: int = 0
    restart_at: Optional[float] = None


def _options(cfg: DictConfig) -> tuple[FaultTolerance, int]:
    node = cfg.strategy.fault_tolerance
    ft = FaultTolerance.from_config(OmegaConf.to_container(node, resolve=True) if hasattr(node, "items") else node)
    if not ft.replicas or ft.replicas < 2:
        raise ConfigError("strategy.fault_tolerance on one node needs strategy.fault_tolerance.replicas >= 2 (the "
                          "replica groups lp-train starts; trainer.devices is split between them).")
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or devices % ft.replicas:
        raise ConfigError(f"trainer.devices={devices!r} must be a multiple of strategy.fault_tolerance.replicas="
                          f"{ft.replicas}: each replica group gets trainer.devices / replicas processes.")
    return ft, devices // ft.replicas


def supervise(cfg: DictConfig) -> int:
    """Start the lighthouse and the groups; restart a failed group up to ``fault_tolerance.max_restarts`` times.

    Returns:
        0 when the groups finished (or stopped on SIGINT/SIGTERM, which ``signals.stop_requested()`` then tells);
        raises ``RuntimeError`` when one failed more often than allowed.
    """
    from hydra.core.hydra_config import HydraConfig

    from lightning_parallel.fault_tolerance.lighthouse import start_lighthouse
    from lightning_parallel.fault_tolerance.replicas import ft_environment

    ft, per_group = _options(cfg)
    hydra = HydraConfig.get()
    run_dir = Path(hydra.runtime.output_dir)
    overrides = [o for o in hydra.overrides.task if not o.lstrip("+").startswith(("trainer.devices=", "hydra."))]
    lighthouse = start_lighthouse(min_replicas=ft.min_replicas, join_timeout_ms=10000, heartbeat_timeout_ms=3000)
    print(f"lp-train: lighthouse at {lighthouse.address()}; {ft.replicas} replica groups of {per_group} "
          f"process(es), each restarted up to {ft.max_restarts} times; their runs: {run_dir}/group<g>[-restart<k>]",
          flush=True)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and vote at info

    def start(group: _GroupProcess) -> None:
        env = {**os.environ, **ft_environment(group.index, ft.replicas, lighthouse.address()),
               "LP_FT_INCARNATION": str(group.restarts), signals.RUN_STOP_FILE: str(stop_marker)}
        folder = run_dir / (f"group{group.index}" + (f"-restart{group.restarts}" if group.restarts else ""))
        command = [sys.executable, "-m", "lightning_parallel.cli.train", *overrides, f"trainer.devices={per_group}",
                   f"hydra.run.dir='{folder}'"]
        # Own session, as lp-train's local ranks: a terminal's Ctrl-C reaches this supervisor only, which forwards
        # it once to every group (runtime/signals.py: each group saves last-stop.ckpt after its current step).
        group.process = subprocess.Popen(command, env=env, cwd=hydra.runtime.cwd, start_new_session=True)
        if shutdown is not None:
            shutdown.children = [g.process for g in groups if g.process is not None]

    groups = [_GroupProcess(g) for g in range(ft.replicas)]
    shutdown, stop_marker = signals.current(), _run_stop_marker(run_dir)
    try:
        for group in groups:
            start(group)
        _watch(groups, ft.max_restarts, start)
    finally:
        for group in groups:
            if group.process is not None and group.process.poll() is None:
                group.process.kill()
        lighthouse.shutdown()
    return 0


def _run_stop_marker(run_dir: Path) -> Path:
    """The file that makes a stop run-wide (``runtime.signals.run_wide_stop``): written by this supervisor before it
    forwards a signal to the groups, which tell it from a signal to one of them (which stops that group only)."""
    marker = run_dir / ".lp" / "run-stop"
    marker.unlink(missing_ok=True)
    shutdown = signals.current()
    if shutdown is not None:
        shutdown.step_finished = True  # nothing to save here; the groups save theirs, so wait for them on a stop
        shutdown.before_forward = lambda: (marker.parent.mkdir(parents=True, exist_ok=True), marker.touch())
    return marker


def _watch(groups: list[_GroupProcess], max_restarts: int, start: Any) -> None:
    """Until every group has exited: restart a failed one (after 5 s, so the others notice its loss first) -- unless
    another group has already finished, when the run is complete and a restart would only train from scratch alone
    (seen: a group restarted after its peer's last step waited for peers and then started over from step 0)."""
    while True:
        finished = [g.index for g in groups if g.restart_at is None and g.process.poll() == 0]
        for group in groups:
            if group.restart_at is not None and (finished or signals.stop_requested()):
                group.restart_at = None
                why = f"group {finished[0]} finished training" if finished else "the run is stopping"
                print(f"lp-train: replica group {group.index} is not restarted: {why}", file=sys.stderr, flush=True)
            elif group.restart_at is not None and time.monotonic() >= group.restart_at:
                group.restart_at = None
                start(group)
            code = group.process.poll() if group.restart_at is None else None
            if code in (None, 0) or finished or signals.stop_requested():
                continue
            if group.restarts >= max_restarts:
                raise RuntimeError(f"replica group {group.index} exited with code {code} after {group.restarts} "
                                   f"restart(s) (fault_tolerance.max_restarts={max_restarts}); see its run folder.")
            group.restarts += 1
            print(f"lp-train: replica group {group.index} exited with code {code}; the others train on; restarting "
                  f"it ({group.restarts}/{max_restarts}) in 5 s", file=sys.stderr, flush=True)
            group.restart_at = time.monotonic() + 5.0
        done = all(g.restart_at is None and g.process.poll() is not None for g in groups)
        if done and (finished or signals.stop_requested()):
            return
        time.sleep(0.2)
