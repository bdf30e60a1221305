"""Fault injection for restart tests (loaded by the entry point through a Hydra override)."""

import os
import signal

import lightning.pytorch as pl


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

