"""Parameter, gradient and optimizer-state bytes per rank for each hybrid layout, beside the formulas.

    python -m benchmarks.memory_per_rank

Fits the GPT recipe (AdamW, fp32) for two steps under each layout of the hybrid strategy
and reads, on every rank, the local bytes of its parameters, of their gradients (just
before the optimizer step) and of the optimizer state (DTensors count their local shard).
Beside each, the formula's value computed on the same rank from metadata alone:

* parameters: for every parameter the rank holds, its *global* bytes divided by the
  product of the mesh sizes it is sharded over (tensor parallel: 1/t for the planned
  matrices; FSDP2 ``zero_stage`` 2/3: 1/d on dim 0); a pipeline rank holds its stages'
  parameters (``parameters_per_stage`` of the split), about 1/p of the model;
* gradients: the same as parameters (sharded alike); optimizer state: AdamW's two moments,
  2x the parameter bytes.

"exact" means measured == formula, byte for byte. The second step runs inside a
:class:`~benchmarks.comm.CommCounter`, giving communication per step for each layout.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial

LAYOUTS = {
    2: {"dp2": {}, "pp2": {"pipeline_parallel_size": 2}, "tp2": {"tensor_parallel_size": 2},
        "dp2 zero2 (FSDP2)": {"zero_stage": 2}, "dp2 zero3 (FSDP2)": {"zero_stage": 3}},
    4: {
        "tp4": {"tensor_parallel_size": 4},
        "pp4": {"pipeline_parallel_size": 4},
        "dp2xpp2": {"pipeline_parallel_size": 2},
        "dp2xtp2": {"tensor_parallel_size": 2},
        "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "dp2xpp2 zero3": {"pipeline_parallel_size": 2, "zero_stage": 3},
        "dp2xtp2 zero3": {"tensor_parallel_size": 2, "zero_stage": 3},
    },
}


def _expected_local(param) -> int:
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.numel() * param.element_size()
    # FSDP2 over a tensor-parallel DTensor shards the same dim twice: the data-axis placement is a
    # _StridedShard, which is not a Shard subclass in this torch.
    shards = math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements)
                       if p.is_shard() or type(p).__name__ == "_StridedShard")
    return param.numel() * param.element_size() // shards


def _counter_callback():
    import lightning.pytorch as pl

    from benchmarks.comm import CommCounter
    from benchmarks.raw_loops import module_bytes

    class Count(pl.Callback):
        """Memory just before the second optimizer step, communication of the second step."""

        def __init__(self) -> None:
            self.memory, self.comm, self.counter = {}, {}, None

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            if trainer.global_step == 1:  # AdamW creates its state in the first step
                self.memory = module_bytes(module, getattr(optimizer, "_optimizer", optimizer))
                expected = sum(_expected_local(p) for p in module.parameters())
                split = getattr(trainer.strategy, "pipeline_split", None)
                if (split is not None and not trainer.strategy.options.zero_stage
                        and not trainer.strategy.layout.tensor_parallel_enabled):
                    # A pure pipeline split: the formula is the stages' parameter count, from the partition.
                    expected = 4 * sum(split.parameters_per_stage[s] for s in split.local_stages)
                self.memory["expected_params"] = expected

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if batch_idx == 1:
                self.counter = CommCounter().__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.comm, self.counter = self.counter.summary(), None

    return Count()


def _rank(rank: int, world_size: int, layouts: dict, model_kwargs: dict, batch: int) -> dict:
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import Subset

    from examples.nlp.data import ByteWindows, load_corpus
    from examples.nlp.model import GPT
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.models import FixedOrderData

    warnings.filterwarnings("ignore")
    train, _ = load_corpus(None, max_bytes=100_000, val_every=10)
    samples = Subset(ByteWindows(train, model_kwargs["seq_len"]), range(8 * batch))
    out = {}
    for name, sizes in layouts.items():
        pl.seed_everything(0, verbose=False)
        count = _counter_callback()
        strategy = HybridParallelStrategy(**sizes) if world_size > 1 else "auto"
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, callbacks=[count], limit_val_batches=0)
        dp = strategy.resolve_layout(world_size).data_parallel if world_size > 1 else 1
        model = GPT(**model_kwargs, optimizer=partial(torch.optim.AdamW, lr=1e-3))
        trainer.fit(model, datamodule=FixedOrderData(samples, batch_size=batch // dp))
        out[name] = {**count.memory, "comm": count.comm}
    return out


def measure(model_kwargs: dict, batch: int = 16, layouts: dict | None = None, timeout: float = 1200) -> list[dict]:
    """Bytes per rank (measured and by formula) for every layout, plus the single-process reference row.

    Args:
        model_kwargs: GPT arguments.
        batch: global batch.
        layouts: ``{world size: {name: HybridParallelStrategy kwargs}}`` (default :data:`LAYOUTS`).
        timeout: seconds per group of processes.
    """
    from lightning_parallel.testing import run_processes

    reference = run_processes(_rank, 1, {"single": {}}, model_kwargs, batch)[0]["single"]
    rows = [_row("single", 1, [reference], reference)]
    for world, group in (layouts or LAYOUTS).items():
        per_rank = run_processes(_rank, world, group, model_kwargs, batch, timeout=timeout)
        rows += [_row(name, world, [r[name] for r in per_rank], reference) for name in group]
    return rows


def _row(name: str, world: int, ranks: list[dict], reference: dict) -> dict:
    row = {"layout": name, "world": world}
    for key in ("params", "grads", "optim"):
        row[key] = [r[key] for r in ranks]
        row[f"{key}_ratio"] = [round(r[key] / reference[key], 3) for r in ranks]
    row["expected_params"] = [r["expected_params"] for r in ranks]
    row["params_exact"] = all(r["params"] == r["expected_params"] for r in ranks)
    row["grads_exact"] = all(r["grads"] == r["expected_params"] for r in ranks)
    row["optim_exact"] = all(r["optim"] == 2 * r["expected_params"] for r in ranks)
    row["exact"] = row["params_exact"] and row["grads_exact"] and row["optim_exact"]
    row["comm"] = ranks[0].get("comm", {})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = measure({"seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4})
    for row in rows:
        print(f"{row['layout']:20s} world {row['world']}  params/rank vs single {row['params_ratio']}  "
              f"optimizer {row['optim_ratio']}  exact {row['exact']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
