"""Fault injection and data-order recording for restart tests (loaded by the entry point through Hydra overrides)."""

import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch


class KillRankAtStep(pl.Callback):
    """SIGKILLs one rank when training reaches ``step``, on the first attempt of a torchrun job only.

    Args:
        rank: global rank to kill.
        step: global step at which it dies (before that step's batch runs).
    """

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordBatches(pl.Callback):
    """Appends ``{"attempt", "step", "batch"}`` per training batch to ``folder/rank<R>.jsonl``.

    ``batch`` is the sum of the input token ids -- enough to tell any two batches of a shuffled
    epoch apart, so the file shows which samples each step trained on, across restarts.

    Args:
        folder: where the per-rank files go (created).
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        record = {
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "step": trainer.global_step,
            "batch": int(torch.as_tensor(inputs).long().sum()),
        }
        with open(self.folder / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
