"""Per-step cost of fault tolerance: replica groups on torchft against the same layout on one fixed process group.

    python -m benchmarks.fault_tolerance_overhead           # 3 rounds of 40 steps (10 warm-up)
    python -m benchmarks.fault_tolerance_overhead --quick   # 1 round of 20 steps (5 warm-up)

Pairs, each the same model (the residual MLP of the parity tests, width 64, depth 4, AdamW), the same global
batch and the same data, one process per rank over gloo, through Lightning's ``Trainer.fit``:

* ``data 2`` (``HybridParallelStrategy(data_parallel_size=2)``, FSDP2's replicated data axis) against
  ``2 groups x 1`` (``fault_tolerance``: two replica groups of one process; the cross-group average, the quorum and
  the commit vote every step);
* ``data 2 x pipeline 2`` on 4 processes against ``2 groups x pipeline 2``.

``--modes``: two replica groups of pipeline 2 under each ``fault_tolerance.mode`` (``ddp``, ``diloco`` with
``sync_every=5``, ``streaming_diloco`` with 2 fragments and ``sync_every=10``, and with a 2-step overlap): the mean
and median step time (a meeting's cost lands in its step: the mean carries it) and the bytes rank 0 sent across
groups per step, counted by wrapping its torchft manager's ``allreduce``.

Peak memory: each rank's peak resident set (``getrusage``), the largest over ranks and rounds.

Step time: ``on_train_batch_start`` to ``on_train_batch_end`` on rank 0 (the quorum is taken inside the step, so it
counts), the median over the timed steps; the two designs of a pair alternate within each round and the ratio is of
the medians over all rounds. Nothing fails here: this is the price of being able to survive a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.step_times import StepTimes
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset
from lightning_parallel.testing.replica_groups import run_replica_groups

WIDTH, DEPTH, BATCH = 64, 4, 16
QUICK = {"rounds": 1, "steps": 20, "warmup": 5}
FULL = {"rounds": 3, "steps": 40, "warmup": 10}
PAIRS = {"data 2": ({"data_parallel_size": 2}, 2, {}, 1),
         "data 2 x pipeline 2": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2,
                                  "schedule": "gpipe"}, 4, {"pipeline_parallel_size": 2, "microbatches": 2,
                                                            "schedule": "gpipe"}, 2)}


class SentBytes(Callback):
    """Bytes this rank's torchft manager all-reduces across groups during training."""

    def __init__(self) -> None:
        self.bytes = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        groups = getattr(trainer.strategy, "replica_groups", None)
        if groups is None:
            return
        send = groups.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return send(tensor, *args, **kwargs)

        groups.manager.allreduce = counted


def timed_rank(rank: int, world_size: int, options: dict, steps: int, ft: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    timer, sent = StepTimes(), SentBytes()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, max_steps=steps, callbacks=[timer, sent],
                         strategy=HybridParallelStrategy(**options, fault_tolerance=ft), use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    model = ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    trainer.fit(model, datamodule=FixedOrderData(regression_dataset(4096, WIDTH), BATCH))
    # Peak resident memory of this rank's process (Linux: KiB), torchft's manager threads and servers included.
    return {"times": timer.times, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "bytes_per_step": sent.bytes / max(len(timer.times), 1)}


def measure(settings: dict) -> list[dict]:
    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    for _ in range(settings["rounds"]):
        for name, (options, world, group_options, group_size) in PAIRS.items():
            fixed = run_processes(timed_rank, world, options, settings["steps"], None, timeout=600)
            groups = [out for group in run_replica_groups(timed_rank, 2, group_size, group_options, settings["steps"],
                                                          {"timeout": 30}, timeout=600).outputs for out in group]
            times.setdefault(name, []).extend(fixed[0]["times"][settings["warmup"]:])
            times.setdefault(f"{name} ft", []).extend(groups[0]["times"][settings["warmup"]:])
            peaks[name] = max(peaks.get(name, 0.0), *(r["peak_rss_mib"] for r in fixed))
            peaks[f"{name} ft"] = max(peaks.get(f"{name} ft", 0.0), *(r["peak_rss_mib"] for r in groups))
    rows = []
    for name in PAIRS:
        base, ft = statistics.median(times[name]), statistics.median(times[f"{name} ft"])
        rows.append({"layout": name, "fixed_ms": base * 1e3, "fault_tolerant_ms": ft * 1e3, "ratio": ft / base,
                     "added_ms": (ft - base) * 1e3, "steps": len(times[name]), "peak_rss_mib": peaks[name],
                     "fault_tolerant_peak_rss_mib": peaks[f"{name} ft"]})
    return rows


MODES = {"ddp": {}, "diloco, sync_every 5": {"mode": "diloco", "sync_every": 5},
         "streaming, 2 fragments, sync_every 10": {"mode": "streaming_diloco", "sync_every": 10},
         "streaming, overlapped 2 steps": {"mode": "streaming_diloco", "sync_every": 10, "sync_delay": 2}}


def measure_modes(settings: dict) -> list[dict]:
    """2 groups x pipeline 2 under each mode of :data:`MODES`, alternating within each round."""
    times: dict[str, list[float]] = {}
    sent: dict[str, float] = {}
    group = PAIRS["data 2 x pipeline 2"][2]
    for _ in range(settings["rounds"]):
        for name, mode in MODES.items():
            outputs = run_replica_groups(timed_rank, 2, 2, group, settings["steps"], {"timeout": 30, **mode},
                                         timeout=600).outputs
            times.setdefault(name, []).extend(outputs[0][0]["times"][settings["warmup"]:])
            sent[name] = outputs[0][0]["bytes_per_step"]
    return [{"mode": name, "median_ms": statistics.median(times[name]) * 1e3,
             "mean_ms": statistics.mean(times[name]) * 1e3, "bytes_per_step": sent[name],
             "bytes_vs_ddp": sent[name] / sent["ddp"]} for name in MODES]


def render_modes(rows: list[dict]) -> str:
    lines = ["| 2 groups x pipeline 2 | median step (ms) | mean step (ms) | bytes per step, rank 0 | vs ddp |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['mode']} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | {r['bytes_per_step']:.0f} | "
              f"{r['bytes_vs_ddp']:.4f} |" for r in rows]
    return "\n".join(lines)


def render(rows: list[dict]) -> str:
    lines = ["| layout | fixed group (ms) | 2 replica groups, torchft (ms) | ratio | added per step (ms) | "
             "peak RSS per rank, fixed / torchft (MiB) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['layout']} | {r['fixed_ms']:.2f} | {r['fault_tolerant_ms']:.2f} | {r['ratio']:.3f} | "
              f"{r['added_ms']:.2f} | {r['peak_rss_mib']:.0f} / {r['fault_tolerant_peak_rss_mib']:.0f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps")
    parser.add_argument("--modes", action="store_true", help="compare fault_tolerance modes instead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")
    settings = QUICK if args.quick else FULL
    start = time.perf_counter()
    rows = measure_modes(settings) if args.modes else measure(settings)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"settings": settings, "runtime_s": time.perf_counter() - start, "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    table = render_modes(rows) if args.modes else render(rows)
    name = "fault_tolerance_modes" if args.modes else "fault_tolerance_overhead"
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / f"{name}.md").write_text(f"# Fault tolerance {'modes' if args.modes else 'overhead'}\n\n{__doc__}"
                                         f"\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
