"""Record the loss every rank sees (to compare a parallel layout with one process) and the batches it trained on.

Note:
    Lightning divides the loss it passes to ``on_train_batch_end`` by
    ``accumulate_grad_batches``; the recorder undoes that, then averages over the
    strategy's data-parallel ranks (``strategy.reduce``), so the recorded value is the mean
    loss of the global batch -- the number a single process on the same batch computes.
    Each rank keeps its own copy: a parity test checks every rank, not just rank 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

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

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        local = loss.detach().double() * trainer.accumulate_grad_batches
        self.local_losses.append(float(local))
        self.losses.append(float(trainer.strategy.reduce(local.clone(), reduce_op="mean")))


class BatchHistory(pl.Callback):
    """Which samples each training step used, on every rank: ``(global step, fingerprint)`` per batch.

    The fingerprint is the sum of the batch's inputs -- enough to tell the batches of a shuffled
    epoch apart -- so two runs trained on the same data in the same order have equal histories.

    Args:
        folder: if given, each record is also appended to ``folder/rank<R>.jsonl`` with the
            torchrun restart attempt, so a history survives a killed and restarted process.

    Attributes:
        batches: ``(global_step, fingerprint)`` per training batch of this process.
    """

    def __init__(self, folder: Optional[str] = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.batches: list[tuple[int, float]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        record = (trainer.global_step, round(float(torch.as_tensor(inputs).double().sum()), 6))
        self.batches.append(record)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            with open(self.folder / f"rank{trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": record[0], "batch": record[1]}) + "\n")


def max_abs_difference(a: list[float], b: list[float]) -> float:
    """Largest absolute difference of two equally long loss curves."""
    if len(a) != len(b):
        raise ValueError(f"Loss curves differ in length: {len(a)} vs {len(b)} steps.")
    return float(torch.tensor(a, dtype=torch.float64).sub(torch.tensor(b, dtype=torch.float64)).abs().max())
