"""Parameter and optimizer-state bytes per rank for each layout, against the unsplit model.

    python -m benchmarks.memory_per_rank

Fits the GPT recipe's model (AdamW, fp32) for one step under each layout of the hybrid
strategy and counts, on every rank, the bytes of its local parameter shards and of its
optimizer state (DTensors counted by their local shard). Expected: tensor parallelism
divides the sharded matrices by t (replicated norms, biases of row-parallel layers and the
position table stay whole), pipeline parallelism splits layers about 1/p, ZeRO-2/3 (FSDP2)
divide optimizer state (and, for 3, parameters) by the data-parallel size.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

LAYOUTS = {
    2: {"dp2": {}, "pp2": {"pipeline_parallel_size": 2}, "tp2": {"tensor_parallel_size": 2}},
    4: {
        "dp2xpp2": {"pipeline_parallel_size": 2},
        "dp2xpp2 zero2": {"pipeline_parallel_size": 2, "zero_stage": 2},
        "dp2xpp2 zero3": {"pipeline_parallel_size": 2, "zero_stage": 3},
        "dp2xtp2": {"tensor_parallel_size": 2},
        "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "pp4": {"pipeline_parallel_size": 4},
        "tp4": {"tensor_parallel_size": 4},
    },
    8: {"dp2xpp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "dp2xpp2xtp2 zero3": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}},
}


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _count_callback():
    import lightning.pytorch as pl

    class Counter(pl.Callback):
        """Counts local parameter and optimizer-state bytes when training ends."""

        params = optim = 0

        def on_train_end(self, trainer, module):
            self.params = sum(_local_bytes(p) for p in module.parameters())
            self.optim = sum(_local_bytes(v) for opt in trainer.optimizers for state in opt.state.values()
                             for v in state.values() if hasattr(v, "numel") and v.ndim > 0)

    return Counter()


def _rank(rank: int, world_size: int, layouts: dict, model_kwargs: dict) -> dict:
    import lightning.pytorch as pl
    import torch

    from torch.utils.data import Subset

    from examples.nlp.data import ByteWindows, load_corpus
    from examples.nlp.model import GPT
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.models import FixedOrderData

    train, _ = load_corpus(None, max_bytes=100_000, val_every=10)
    samples = Subset(ByteWindows(train, model_kwargs["seq_len"]), range(64))

    out = {}
    for name, sizes in layouts.items():
        pl.seed_everything(0)
        count = _count_callback()
        strategy = HybridParallelStrategy(**sizes) if world_size > 1 else "auto"
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, callbacks=[count], limit_val_batches=0)
        dp = strategy.resolve_layout(world_size).data_parallel if world_size > 1 else 1
        model = GPT(**model_kwargs, optimizer=partial(torch.optim.AdamW, lr=1e-3))
        trainer.fit(model, datamodule=FixedOrderData(samples, batch_size=8 // dp))
        out[name] = {"params": count.params, "optim": count.optim}
    return out


def measure(model_kwargs: dict) -> list[dict]:
    """Bytes per rank for every layout, plus the single-process reference row."""
    from lightning_parallel.testing import run_processes

    reference = run_processes(_rank, 1, {"single": {}}, model_kwargs)[0]["single"]
    rows = [{"layout": "single", "world": 1, **reference, "params_ratio": [1.0], "optim_ratio": [1.0]}]
    for world, layouts in LAYOUTS.items():
        per_rank = run_processes(_rank, world, layouts, model_kwargs, timeout=1200)
        for name in layouts:
            params = [r[name]["params"] for r in per_rank]
            optim = [r[name]["optim"] for r in per_rank]
            rows.append({"layout": name, "world": world, "params": params, "optim": optim,
                         "params_ratio": [round(p / reference["params"], 3) for p in params],
                         "optim_ratio": [round(o / reference["optim"], 3) for o in optim]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = measure({"seq_len": 32, "d_model": 128, "n_layer": 4, "n_head": 4})
    for row in rows:
        print(f"{row['layout']:20s} world {row['world']}  params/rank vs single {row['params_ratio']}  optimizer state {row['optim_ratio']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
