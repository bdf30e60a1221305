"""Training stall per checkpoint: ``async_save=True`` against the synchronous sharded save, side by side.

    python -m benchmarks.async_checkpoint            # 2 rounds, 3 saves each, a 201 MB model (pipeline 2, AdamW)
    python -m benchmarks.async_checkpoint --quick    # 1 round

The model is the parity tests' residual MLP at width 2048, hidden 4096, depth 3 (50.4 M parameters: 201 MB of fp32
weights, 806 MB with AdamW's two states and the gradients' absence in the checkpoint: weights + 2 states = 604 MB per
checkpoint over the two pipeline ranks). Each run trains ``3 x EVERY`` steps and saves every ``EVERY`` steps through
``ModelCheckpoint`` (the sharded folder into this machine's temp directory).

Stall: the time the training thread spends in ``HybridParallelStrategy.save_checkpoint`` (rank 0; every rank waits
at the same collectives), per save, median over saves and rounds. For the asynchronous save that is the parameter
order exchange, the copy to CPU memory and the start of the background write; the write itself overlaps the next
steps. Step time: the median ``on_train_batch_start`` to ``on_train_batch_end`` of the steps without a save, to show
what the background write costs the steps it overlaps (2 shared cores here: it competes with training for them).
The target (issue 46): the asynchronous stall at most 15% of the synchronous one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.step_times import StepTimes
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

WIDTH, HIDDEN, DEPTH, BATCH, EVERY = 2048, 4096, 3, 8, 4


def _timed_saves(strategy: HybridParallelStrategy) -> list[float]:
    """Wrap the strategy's ``save_checkpoint`` so each call's duration is recorded; returns the list."""
    stalls: list[float] = []
    inner = strategy.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        inner(*args, **kwargs)
        stalls.append(time.perf_counter() - started)

    strategy.save_checkpoint = save_checkpoint
    return stalls


def _rank(rank: int, world_size: int, async_save: bool, folder: str) -> dict[str, Any]:
    pl.seed_everything(0)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, data_parallel_size=1, microbatches=2,
                                      async_save=async_save)
    stalls, times = _timed_saves(strategy), StepTimes()
    saver = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=EVERY, filename="step{step}",
                            auto_insert_metric_name=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3 * EVERY, limit_val_batches=0,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[times, saver])
    data = FixedOrderData(regression_dataset(3 * EVERY * BATCH, WIDTH), batch_size=BATCH)
    model = ResidualMLP(width=WIDTH, depth=DEPTH, hidden=HIDDEN, optimizer="adamw")
    trainer.fit(model, datamodule=data)
    saved_steps = {EVERY * k - 1 for k in (1, 2, 3)}
    plain = [t for i, t in enumerate(times.times) if i not in saved_steps and i > 0]
    return {"stalls": stalls, "step": statistics.median(plain),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    rounds = 1 if args.quick else 2
    samples: dict[str, dict[str, list[float]]] = {"sync": {"stall": [], "step": []}, "async": {"stall": [], "step": []}}
    for _ in range(rounds):
        for name in ("sync", "async"):  # alternate within each round
            with tempfile.TemporaryDirectory(prefix="lp-async-bench-") as folder:
                rank0 = run_processes(_rank, 2, name == "async", folder, timeout=1800)[0]
            samples[name]["stall"] += rank0["stalls"]
            samples[name]["step"].append(rank0["step"])
    rows = {name: {"stall_s": statistics.median(s["stall"]), "saves": len(s["stall"]),
                   "step_s": statistics.median(s["step"])} for name, s in samples.items()}
    ratio = rows["async"]["stall_s"] / rows["sync"]["stall_s"]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": f"ResidualMLP width {WIDTH} hidden {HIDDEN} depth {DEPTH}", "layout": "pipeline 2",
            "saves_every": EVERY, "rounds": rounds}
    (args.out / "async_checkpoint.json").write_text(json.dumps({"meta": meta, "rows": rows, "ratio": ratio}, indent=2))
    for name, row in rows.items():
        print(f"{name:6s} stall per save {row['stall_s']:.3f} s (median of {row['saves']}), "
              f"step without a save {row['step_s']:.3f} s")
    print(f"async / sync stall: {ratio:.1%} (target <= 15%)")


if __name__ == "__main__":
    main()
