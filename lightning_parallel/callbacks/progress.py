"""A progress bar in optimizer steps out of ``max_steps``: the unit ``lp-train`` runs are measured in.

Lightning's bar counts batches of the current epoch and labels it with the epoch, which reads
"Epoch 0/-2" under ``max_epochs=-1`` and restarts at every epoch (and after a resume).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """One training bar for the whole run: ``step N/max_steps``, continued from the resumed step."""

    @override
    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        bar.initial = 0
        bar.n = trainer.global_step  # a resumed run starts where it stopped
        bar.set_description("step")
        bar.refresh()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description(f"step (epoch {trainer.current_epoch})")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        step = trainer.global_step
        if (
            bar is not None
            and not bar.disable
            and self.refresh_rate
            and (step % self.refresh_rate == 0 or step == bar.total)
        ):
            bar.n = step
            bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_end(self, *_: Any) -> None:
        self.train_progress_bar.close()
