"""Record the loss every rank sees, to compare a parallel layout with one process.

Note:
    Lightning divides the loss it passes to ``on_train_batch_end`` by
    ``accumulate_grad_batches``; the recorder undoes that, then averages over the
    strategy's data-parallel ranks (``strategy.reduce``), so the recorded value is the mean
    loss of the global batch -- the number a single process on the same batch computes.
    Each rank keeps its own copy: a parity test checks every rank, not just rank 0.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class LossHistory(pl.Callback):
    """Keeps the global-batch mean training loss of every batch, on every rank.

    Attributes:
        losses: one float per training batch, in order.
        local_losses: this rank's own (un-reduced) loss per batch.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.local_losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        local = loss.detach().double() * trainer.accumulate_grad_batches
        self.local_losses.append(float(local))
        self.losses.append(float(trainer.strategy.reduce(local.clone(), reduce_op="mean")))


def max_abs_difference(a: list[float], b: list[float]) -> float:
    """Largest absolute difference of two equally long loss curves."""
    if len(a) != len(b):
        raise ValueError(f"Loss curves differ in length: {len(a)} vs {len(b)} steps.")
    return float(torch.tensor(a, dtype=torch.float64).sub(torch.tensor(b, dtype=torch.float64)).abs().max())
