"""PowerSGD and fp16 compression against exact all-reduce on the GPT recipe: loss curves and final gaps.

``python -m benchmarks.powersgd_study [--steps 300] [--out-dir benchmarks/results]`` runs
``lp-train experiment=nlp_gpt`` (DDP, 2 processes, same seed and data) once per variant of
``strategy.comm_hook`` -- ``none`` (exact), ``powersgd`` rank 1 and rank 4, ``fp16`` -- reads
each run's TensorBoard scalars and ``metrics.json``, and writes
``<out-dir>/<date>/powersgd_study.{json,md}``: the final train loss (mean of the last 5 logged
points, rank 0's batch as Lightning logs it), the final validation loss, and each one's gap to
exact, plus both curves.

Shrunk to fit about 8 minutes on 2 CPU cores, and said so in the outputs: the recipe's GPT at
width 64, 2 blocks, 64-token windows (the recipe itself: 128, 4, 128), global batch 32, lr 3e-3
with 30 warm-up steps as the recipe; validation every 50 steps on 8 batches. PowerSGD starts
after the warm-up (``powersgd_start_iter=30``, torch's advice: no earlier than the warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

VARIANTS = {
    "exact": ["strategy.comm_hook=none"],
    "powersgd rank 1": ["strategy.comm_hook=powersgd", "strategy.powersgd_rank=1", "strategy.powersgd_start_iter=30"],
    "powersgd rank 4": ["strategy.comm_hook=powersgd", "strategy.powersgd_rank=4", "strategy.powersgd_start_iter=30"],
    "fp16": ["strategy.comm_hook=fp16"],
}
SHRUNK = ["model.d_model=64", "model.n_layer=2", "data.seq_len=64", "data.max_val_batches=8", "data.max_bytes=1000000",
          "trainer.val_check_interval=50", "trainer.enable_progress_bar=false", "callbacks=none"]


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one TensorBoard scalar written under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def run_variant(name: str, overrides: list[str], steps: int, workdir: Path) -> dict[str, Any]:
    """Train one variant with ``lp-train`` on 2 processes; return its curves and final losses."""
    folder = workdir / name.replace(" ", "_")
    command = [sys.executable, "-m", "lightning_parallel.cli.train", "experiment=nlp_gpt", *SHRUNK, *overrides,
               f"trainer.max_steps={steps}", f"hydra.run.dir={folder}"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    train = _scalars(folder / "tensorboard", "train_loss")
    val = _scalars(folder / "tensorboard", "val_loss")
    final = json.loads((folder / "metrics.json").read_text())["metrics"]
    return {"overrides": overrides, "seconds": time.perf_counter() - start, "train_curve": train, "val_curve": val,
            "final_train_loss": statistics.fmean(v for _, v in train[-5:]), "final_val_loss": final["val_loss"]}


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    """The study as a Markdown table plus the validation curves side by side."""
    exact = results["exact"]
    lines = [f"# PowerSGD / fp16 vs exact all-reduce, GPT recipe ({meta['date']})", "",
             f"`{meta['command']}`; {meta['setting']}", "",
             "| variant | final train loss | gap to exact | final val loss | gap to exact | wall s |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['final_train_loss']:.4f} "
                     f"| {r['final_train_loss'] - exact['final_train_loss']:+.2e} "
                     f"| {r['final_val_loss']:.4f} | {r['final_val_loss'] - exact['final_val_loss']:+.2e} "
                     f"| {r['seconds']:.0f} |")
    steps = [s for s, _ in exact["val_curve"]]
    lines += ["", "Validation loss per step:", "", "| step | " + " | ".join(results) + " |",
              "|---|" + "---|" * len(results)]
    for i, step in enumerate(steps):
        row = [f"{r['val_curve'][i][1]:.4f}" if i < len(r["val_curve"]) else "-" for r in results.values()]
        lines.append(f"| {step} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="lp-powersgd-") as tmp:
        for name, overrides in VARIANTS.items():
            results[name] = run_variant(name, overrides, args.steps, Path(tmp))
            print(f"[powersgd_study] {name}: train {results[name]['final_train_loss']:.4f}, "
                  f"val {results[name]['final_val_loss']:.4f} ({results[name]['seconds']:.0f} s)", flush=True)
    meta = {"date": str(date.today()), "steps": args.steps,
            "command": f"python -m benchmarks.powersgd_study --steps {args.steps}",
            "setting": f"lp-train experiment=nlp_gpt {' '.join(SHRUNK)} trainer.max_steps={args.steps}: DDP on 2 CPU "
                       "processes (gloo), global batch 32, AdamW lr 3e-3, 30 warm-up steps, seed 1234; shrunk from "
                       "the recipe's width 128 x 4 blocks x 128 tokens to fit ~8 minutes on 2 CPU cores. Train loss: "
                       "mean of the last 5 logged points (every 10 steps, rank 0's batch)."}
    out = Path(args.out_dir) / meta["date"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "powersgd_study.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "powersgd_study.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
