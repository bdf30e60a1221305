"""Real 4-rank runs of the ViT and DLRM recipes under the hybrid strategy -- the bytes each rank stores after its
first optimizer step, and one step's collectives and saved activations -- and the same layouts' simulations
(``tests/distributed/planner/test_simulation_recipes.py``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

from tests.distributed.planner.simulation_runs import WORLD, AfterFirstStep
from tests.distributed.planner.step_runs import CountStep

BATCH = 8  # the global batch
VIT = {"image_size": 8, "patch_size": 2, "in_channels": 1, "num_classes": 10, "d_model": 64, "n_layer": 2,
       "n_head": 4, "mlp_ratio": 2}
# Tables of 4,096 / 2,048 / 32 / 32 / 24 rows (the recipe's), 16 wide; the tensor axis shards their rows.
DLRM = {"num_dense": 4, "table_sizes": [4096, 2048, 32, 32, 24], "embedding_dim": 16, "bottom_widths": [64],
        "top_widths": [64, 32]}

# name -> (HybridParallelStrategy options, recipe)
RECIPE_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "vit dp2 x tp2 zero3": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3}, "vit"),
    "vit dp2 x pp2": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2}, "vit"),
    "dlrm dp2 x tp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, "dlrm"),
    "dlrm dp4 zero2": ({"data_parallel_size": 4, "zero_stage": 2}, "dlrm"),
}


def pipelined(name: str) -> bool:
    return RECIPE_CASES[name][0].get("pipeline_parallel_size", 1) > 1


def recipe(name: str) -> Any:
    """Builds the case's model (AdamW, no warm-up)."""
    kind = RECIPE_CASES[name][1]
    optimizer = partial(torch.optim.AdamW, lr=1e-3)
    if kind == "vit":
        from examples.vision.model import ViT

        return partial(ViT, **VIT, optimizer=optimizer, warmup_steps=0)
    from examples.recsys.model import DLRM as Model

    return partial(Model, **DLRM, optimizer=optimizer, warmup_steps=0)


def dataset(kind: str, samples: int = 32) -> Any:
    """Fixed samples: 8 x 8 one-channel images and labels, or dense features, one id per table and clicks."""
    generator = torch.Generator().manual_seed(0)
    if kind == "vit":
        return torch.utils.data.TensorDataset(torch.randn(samples, 1, 8, 8, generator=generator),
                                              torch.randint(0, 10, (samples,), generator=generator))
    ids = torch.stack([torch.randint(0, rows, (samples,), generator=generator) for rows in DLRM["table_sizes"]], 1)
    return torch.utils.data.TensorDataset(torch.randn(samples, DLRM["num_dense"], generator=generator), ids,
                                          torch.randint(0, 2, (samples,), generator=generator))


def measure_recipes(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Fit every named case; per case, this rank's bytes after the first step and one step's collectives and
    saved bytes (the second step under pipelining: the first also infers the stages' shapes)."""
    from lightning_parallel import _compat
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData

    out = {}
    for name in names:
        options, kind = RECIPE_CASES[name]
        _compat.clear_dtensor_caches()  # one process runs every layout (tests/distributed/planner/step_runs.py)
        pl.seed_everything(0)
        held, counter = AfterFirstStep(), CountStep(step=1 if pipelined(name) else 0)
        strategy = HybridParallelStrategy(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options})
        trainer = quiet_trainer(world_size, strategy, 2 if pipelined(name) else 1, [held, counter],
                                limit_val_batches=0)
        data = FixedOrderData(dataset(kind), batch_size=BATCH // options["data_parallel_size"])
        trainer.fit(recipe(name)(), datamodule=data)
        out[name] = {**held.held, "collectives": counter.collectives, "activation_bytes": counter.activation_bytes}
    return out


def simulated_recipe(name: str) -> Any:
    """The simulation of case ``name`` on :data:`WORLD` ranks with one step of the same batch shape."""
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner import simulate
    from lightning_parallel.planner.simulation.batches import click_batch, image_batch

    options, kind = RECIPE_CASES[name]
    per_rank = BATCH // options["data_parallel_size"]
    batch = (partial(image_batch, per_rank, 1, 8) if kind == "vit"
             else partial(click_batch, per_rank, DLRM["num_dense"], len(DLRM["table_sizes"])))
    full = {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options}
    return simulate(recipe(name), ParallelOptions(**full), WORLD, batch=batch)
