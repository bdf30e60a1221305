"""``lp-train`` as a user runs it, for the integration tests: a process from a folder (forked from the session's fork
server: tests/integration/forked_cli.py), its result, its losses."""

import os
from pathlib import Path
from typing import Optional

from tests.integration.forked_cli import forked_or_spawned

ROOT = Path(__file__).resolve().parents[2]


def lp_train_env(**extra: str) -> dict[str, str]:
    """The environment of an ``lp-train`` run from a test: one thread per rank, the checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def lp_train(args: list[str], cwd: Path, timeout: float = 300, env: Optional[dict[str, str]] = None):
    """``lp-train *args`` in ``cwd``; its ``CompletedProcess`` (output captured)."""
    return forked_or_spawned("lightning_parallel.cli.train", args, cwd, env or lp_train_env(), timeout)


def ok(result) -> str:
    """The run's output, after asserting it exited 0 (the output's tail is the assertion's message)."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def logged_scalars(tensorboard_dir: Path, tag: str) -> dict[int, float]:
    """``{step: value}`` of ``tag`` over every TensorBoard event file of a run (a step logged twice fails)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in sorted(tensorboard_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if tag in accumulator.Tags()["scalars"]:
            for event in accumulator.Scalars(tag):
                assert event.step not in values, f"step {event.step} logged twice"
                values[event.step] = event.value
    return values
