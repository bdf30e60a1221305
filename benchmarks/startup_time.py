"""Start-up of ``lp-train`` on several local processes: ranks forked after the launcher's imports vs new interpreters.

    python -m benchmarks.startup_time              # 2 and 4 processes, 5 runs each way
    python -m benchmarks.startup_time --quick      # 2 processes, 3 runs each way

Each run is the GPT recipe (``model=gpt_tiny``, DDP or the hybrid strategy with a pipeline of 2) for one training
step, no validation, logger or callbacks (no end-of-run evaluation), from the command to the process's exit: what a
user waits for before the first step, plus a short teardown that is the same both ways. ``LP_START_METHOD=spawn``
starts each rank as ``python -m lightning_parallel.cli.train`` (every rank imports torch, Lightning and the suite,
composes and checks the job again); the default on CPU forks the ranks from the launcher once it has done that
(cli/forked_rank.py). The two are run alternately, so load from other jobs on the machine falls on both; medians and
their ratio are printed.
Target (issue 42): forked <= 0.6 x spawned at 2 processes.
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

LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "hybrid_pp2": ["strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1"],
}
ONE_STEP = ["model=gpt_tiny", "trainer=cpu_test", "trainer.max_steps=1", "trainer.limit_val_batches=0",
            "logger=none", "callbacks=none", "trainer.enable_progress_bar=false"]


def one_run(method: str, devices: int, layout: str, workdir: Path) -> float:
    """Seconds from the command to the exit of one ``lp-train`` run started the way ``method`` says."""
    env = {**os.environ, "LP_START_METHOD": method, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lightning_parallel.cli.train", *LAYOUTS[layout], *ONE_STEP,
               f"trainer.devices={devices}"]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{method} run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 processes, DDP, 3 runs each way")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 5)
    cells = [(2, "ddp")] if args.quick else [(2, "ddp"), (2, "hybrid_pp2"), (4, "hybrid_pp2")]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        for devices, layout in cells:
            times: dict[str, list[float]] = {"spawn": [], "fork": []}
            one_run("fork", devices, layout, workdir)  # warm the file cache; not counted
            for _ in range(runs):
                for method in ("spawn", "fork"):
                    times[method].append(one_run(method, devices, layout, workdir))
            spawn, fork = statistics.median(times["spawn"]), statistics.median(times["fork"])
            rows.append({"processes": devices, "layout": layout, "spawn_s": spawn, "fork_s": fork,
                         "ratio": fork / spawn, "runs": runs, "spawn_all": times["spawn"], "fork_all": times["fork"]})
            print(f"{devices} processes, {layout:10s}: spawned ranks {spawn:6.2f} s, forked {fork:6.2f} s "
                  f"(median of {runs}): ratio {fork / spawn:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup_time.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
