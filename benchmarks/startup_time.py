"""Start-up of ``lp-train`` on several local processes: ranks forked after the launcher's imports vs new interpreters.

    python -m benchmarks.startup_time              # 2 and 4 processes, 5 runs each way
    python -m benchmarks.startup_time --quick      # 2 processes, 3 runs each way

Each run is the GPT recipe (``model=gpt_tiny``, DDP or the hybrid strategy with a pipeline of 2) for one training
step, no validation, logger or end-of-run evaluation: timed from the command to the start of the last rank's first
batch (what a user waits for) and to the exit (plus a short teardown, the same both ways). ``LP_START_METHOD=spawn``
starts each rank as ``python -m lightning_parallel.cli.train`` (every rank imports torch, Lightning and the suite,
composes and checks the job again); the default on CPU forks the ranks from the launcher once it has done that
(cli/forked_rank.py). The two are run alternately, so load from other jobs on the machine falls on both; medians and
their ratio are printed.
``--baseline DIR`` runs the spawned side from another checkout (a git worktree of an older commit): the code of
before against the forked start of now. Target (issue 42): forked <= 0.6 x spawned at 2 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Optional

LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "hybrid_pp2": ["strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1"],
}
ONE_STEP = ["model=gpt_tiny", "trainer=cpu_test", "trainer.max_steps=1", "trainer.limit_val_batches=0",
            "logger=none", "callbacks=none", "trainer.enable_progress_bar=false"]


STAMP_ENV = "LP_BENCH_FIRST_STEP_FILE"
# The callback every rank runs, written next to the runs as a module of its own, so that a baseline checkout
# (--baseline, which has no benchmarks.startup_time) loads it too.
STAMP_MODULE = '''import os, time
from pathlib import Path
import lightning.pytorch as pl


class FirstStepStamp(pl.Callback):
    """Writes the wall-clock time this rank starts its first training batch to $LP_BENCH_FIRST_STEP_FILE.rank<r>."""

    def on_train_batch_start(self, trainer, *args):
        path = Path(os.environ["LP_BENCH_FIRST_STEP_FILE"] + f".rank{trainer.global_rank}")
        if not path.exists():
            path.write_text(repr(time.time()))
'''


def one_run(method: str, devices: int, layout: str, workdir: Path,
            source: Optional[Path] = None) -> tuple[float, float]:
    """Seconds from the command to the first training step of the last rank, and to the exit, of one ``lp-train`` run
    started the way ``method`` says (``source``: the checkout whose lightning_parallel runs; None: the installed
    one)."""
    stamp = workdir / f"first-step-{method}-{time.monotonic_ns()}"
    path = [str(workdir), *([str(source)] if source else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "LP_START_METHOD": method, "OMP_NUM_THREADS": "1", STAMP_ENV: str(stamp),
           "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    command = [sys.executable, "-m", "lightning_parallel.cli.train", *LAYOUTS[layout], *ONE_STEP,
               f"trainer.devices={devices}", "+callbacks.stamp._target_=lp_bench_stamp.FirstStepStamp"]
    started_wall, started = time.time(), time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{method} run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    first = max(float(Path(f"{stamp}.rank{r}").read_text()) for r in range(devices))
    return first - started_wall, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 processes, DDP, 3 runs each way")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout (e.g. a git worktree of an older commit) whose lp-train the spawned runs use: "
                             "today's code against the forked start")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    cells = [(2, "ddp")] if args.quick else [(2, "ddp"), (2, "hybrid_pp2"), (4, "hybrid_pp2")]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        (workdir / "lp_bench_stamp.py").write_text(STAMP_MODULE)
        for devices, layout in cells:
            first: dict[str, list[float]] = {"spawn": [], "fork": []}
            whole: dict[str, list[float]] = {"spawn": [], "fork": []}
            one_run("fork", devices, layout, workdir)  # warm the file cache; not counted
            for _ in range(runs):
                for method in ("spawn", "fork"):
                    to_first, to_exit = one_run(method, devices, layout, workdir,
                                                args.baseline if method == "spawn" else None)
                    first[method].append(to_first)
                    whole[method].append(to_exit)
            row = {"processes": devices, "layout": layout, "runs": runs, "first_step": first, "exit": whole}
            for key, times in (("first_step", first), ("exit", whole)):
                spawn, fork = statistics.median(times["spawn"]), statistics.median(times["fork"])
                row[f"{key}_spawn_s"], row[f"{key}_fork_s"], row[f"{key}_ratio"] = spawn, fork, fork / spawn
                what = key.replace("_", " ")
                print(f"{devices} processes, {layout:10s} to {what:10s}: spawned ranks {spawn:6.2f} s, "
                      f"forked {fork:6.2f} s (median of {runs}): ratio {fork / spawn:.2f}", flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup_time.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
