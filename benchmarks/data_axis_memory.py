"""Peak resident memory per rank on the replicated data axis: torch DDP (what ``zero_stage=0`` builds when nothing
else shards) against FSDP2 on a ``(data, 1)`` mesh (what it built before, and still builds beside a pipeline).

    python -m benchmarks.data_axis_memory [--d-model 512] [--n-layer 8] [--steps 4]

Every row runs in 2 fresh processes: each builds the GPT recipe (seeded, fp32), resets its peak resident set
(``/proc/self/clear_refs``), wraps the model and trains ``--steps`` AdamW steps on the recipe's byte windows, then
reads its peak (``VmHWM``). The growth is reported beside the model's bytes P: a replicated data axis holds at least
gradients (P) and AdamW's two moments (2P) beyond the parameters, so 3P is the floor; the rest is activations,
communication buffers and the allocator. Rows:

* ``raw DDP``: ``DistributedDataParallel`` with torch's defaults (gradients and buckets apart: one P more);
* ``raw DDP bucket view``: ``gradient_as_bucket_view=True``, the settings of the suite's DDP data axis;
* ``raw FSDP2 (2, 1)``: ``fully_shard`` per layer on a 2 x 1 mesh, the suite's former ``zero_stage=0``;
* ``suite hybrid zero_stage=0``: ``HybridParallelStrategy`` under a Trainer (its growth also holds the Trainer's
  objects and Lightning's loop: compare it with the raw rows for what the strategy adds).
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path
from typing import Any

ROWS = ("raw DDP", "raw DDP bucket view", "raw FSDP2 (2, 1)", "suite hybrid zero_stage=0")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5" resets VmHWM to the current resident set (Linux)
        handle.write("5")


def _peak_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this benchmark reads Linux's peak resident set")


def _loader(model_kwargs: dict, rank: int, batch: int, steps: int) -> Any:
    """This rank's share of ``steps`` global batches of the recipe's byte windows."""
    from benchmarks.layouts import gpt_datasets, loader

    data = {"max_bytes": 400_000, "train_samples": batch * steps * 2, "val_samples": batch}
    train, _ = gpt_datasets(model_kwargs, data)
    return loader(train, batch, 2, rank)


def _trainer_row(model: Any, batches: Any, steps: int) -> None:
    import lightning.pytorch as pl

    from lightning_parallel.strategies import HybridParallelStrategy

    strategy = HybridParallelStrategy(pipeline_parallel_size=1, tensor_parallel_size=1, zero_stage=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, train_dataloaders=batches)


def _rank(rank: int, world: int, row: str, model_kwargs: dict, batch: int, steps: int) -> dict:
    import torch.distributed as dist

    from benchmarks.layouts import _new_model
    from benchmarks.raw_loops import RawDDP, RawFSDP2

    batches = _loader(model_kwargs, rank, batch, steps)
    model = _new_model(model_kwargs)
    param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if row.startswith("suite"):
        _reset_peak()
        start = _peak_mib()
        _trainer_row(model, batches, steps)
    else:
        dist.init_process_group("gloo")
        loop = {"raw DDP": lambda: RawDDP(model, rank, world),
                "raw DDP bucket view": lambda: RawDDP(model, rank, world, bucket_view=True),
                "raw FSDP2 (2, 1)": lambda: RawFSDP2(model, rank, world, replicate=world)}[row]()
        _reset_peak()
        start = _peak_mib()
        loop.build()
        for step_batch in batches:
            loop.step(step_batch)
    return {"growth_mib": _peak_mib() - start, "param_mib": param_mib}


def measure(model_kwargs: dict, batch: int, steps: int) -> list[dict]:
    """One row per wrapping: peak growth per rank (mean, max) and in units of the model's bytes P."""
    from lightning_parallel.testing import run_processes

    rows = []
    for row in ROWS:
        per_rank = run_processes(_rank, 2, row, model_kwargs, batch, steps, timeout=1200,
                                 env={"PYTHONWARNINGS": "ignore"})
        growth = [r["growth_mib"] for r in per_rank]
        p = per_rank[0]["param_mib"]
        rows.append({"row": row, "P_mib": round(p, 1), "growth_mean_mib": round(sum(growth) / len(growth), 1),
                     "growth_max_mib": round(max(growth), 1), "growth_over_P": round(max(growth) / p, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    model_kwargs = {"d_model": args.d_model, "n_layer": args.n_layer, "n_head": 8, "seq_len": args.seq_len}
    rows = measure(model_kwargs, args.batch, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_axis_memory.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    for row in rows:
        print(" | ".join(f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
