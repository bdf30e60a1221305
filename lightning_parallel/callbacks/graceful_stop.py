"""Stop every rank at the same optimizer step after SIGINT/SIGTERM, with a checkpoint to resume from.

See :mod:`lightning_parallel.runtime.signals` for the whole stop: the signal marks this process, and
after each optimizer step the ranks all-reduce their marks (one element, MAX), so they all stop
after the same step, write ``last-stop.ckpt`` together (a collective under sharded strategies) and
leave ``fit`` normally, without the validation Lightning runs when training is stopped early.

Note:
    The name is not ``last.ckpt``: a ``ModelCheckpoint(save_last=True)`` that finds a ``last.ckpt``
    it did not write saves its own next one as ``last-v1.ckpt``. ``resume=`` and ``ckpt_path=last``
    take the newest ``last*.ckpt`` (:func:`lightning_parallel.cli.run_resume.last_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_parallel.runtime import signals


class GracefulStop(pl.Callback):
    """Ends training after the optimizer step at which any rank was asked to stop, and saves it.

    Args:
        checkpoint_dir: where ``last-stop.ckpt`` is written (the run's ``checkpoints`` folder).
    """

    def __init__(self, checkpoint_dir: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.saved: Optional[Path] = None
        self.stopped_at: Optional[int] = None
        self._last_step = -1

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's SIGTERM handler broadcasts from inside the handler (a collective at a random
        # point of one rank's program); the suite's handlers take SIGTERM back.
        signals.take_handlers()

    def _any_rank_asked(self, trainer: pl.Trainer) -> bool:
        asked = torch.tensor([1.0 if signals.stop_requested() else 0.0], device=trainer.strategy.root_device)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        return bool(asked.item())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # mid-accumulation: only an optimizer step is a place to stop (same on every rank)
        self._last_step = trainer.global_step
        shutdown = signals.current()
        if shutdown is not None:
            shutdown.step_finished = True
        if not self._any_rank_asked(trainer):
            return
        path = self.checkpoint_dir / "last-stop.ckpt"
        trainer.save_checkpoint(str(path))
        self.saved, self.stopped_at = path, trainer.global_step
        if shutdown is not None:
            shutdown.saved = str(path)
        trainer.should_stop = True
        trainer.limit_val_batches = 0  # Lightning validates when stopped early: not while the user waits for Ctrl-C
