"""``partition="time"``: every pipeline layer timed on one training batch, the times agreed across ranks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_parallel import _compat
from lightning_parallel.parallel.adapter import ModelAdapter
from lightning_parallel.parallel.pipeline.partition import measure_layer_times


def train_dataloader(trainer: pl.Trainer) -> Any:
    """The training loader, through the public hooks where they can give it."""
    if trainer.datamodule is not None:
        return trainer.datamodule.train_dataloader()
    return _compat.fit_loop_train_dataloader(trainer)  # loaders passed straight to fit()


def agreed_layer_times(adapter: ModelAdapter, trainer: pl.Trainer, microbatches: int, device: torch.device,
                       world_size: int) -> list[float]:
    """Per-layer forward+backward seconds on one micro-batch, averaged over all ranks so every rank cuts the same way.

    Args:
        adapter: the model's adapter (its module's ``pipeline_layers()``, its batch split).
        trainer: the Trainer (its training loader gives the batch).
        microbatches: the schedule's micro-batches (the sample is one micro-batch).
        device: this rank's device.
        world_size: ranks to average over (every rank of the default group calls this).
    """
    try:
        batch = next(iter(train_dataloader(trainer)))
    except Exception as error:  # noqa: BLE001 - any failure here means: no sample batch
        raise ValueError(
            "partition='time' measures layers on a training batch, but none could be loaded: use 'parameters'."
        ) from error
    inputs, _ = adapter.split_batch(batch)
    sample = inputs[: max(1, inputs.shape[0] // microbatches)].to(device)
    times = torch.tensor(measure_layer_times(adapter.module.pipeline_layers(), sample), dtype=torch.float64)
    dist.all_reduce(times)
    return (times / world_size).tolist()
