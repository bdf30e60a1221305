"""Record each rank's step and phase as it trains, so that a collective timeout names the ranks that never arrived.

See :mod:`lightning_parallel.runtime.rank_record` for the record. The suite's strategies put the sentence into their
:class:`~lightning_parallel.strategies.hybrid.CollectiveTimeout`; under any other strategy (Lightning's DDP,
DeepSpeed, TorchRec) gloo's own timeout error gets it as a note, which its traceback prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_parallel.runtime import rank_record

MARK = "Where the ranks were"
LOST_PEER = ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
# What reading a file cut short or removed raises (torch's zip reader, DCP's shards, DeepSpeed's folders): seen in
# the fault matrix as "EOFError", "OSError: [Errno 22] Invalid argument", "failed finding central directory".
UNREADABLE = ("EOFError", "Errno", "zip archive", "central directory", "corrupted", "No such file")


def damaged_checkpoint_note(path: Path) -> str:
    """What to do when reading checkpoint ``path`` failed before the first step: the checkpoints beside it."""
    others = sorted((p for p in path.parent.glob("*.ckpt") if p != path), key=lambda p: p.stat().st_mtime)
    earlier = ", ".join(p.name for p in others[-3:]) or "none beside it"
    return (f"Reading the checkpoint {path} failed before the first step: a file of it is cut short, missing or "
            f"unreadable (written completely, then damaged?). Resume from an earlier one in {path.parent}: {earlier}.")


class RankRecorder(pl.Callback):
    """Publishes this rank's phase at every hook a step passes; explains a collective timeout with the others'.

    Args:
        settle_s: after a timeout, at most this long to let the ranks that wait too mark their own timeouts.
        store_timeout_s: how long one store operation may wait.
    """

    def __init__(self, settle_s: float = 1.0, store_timeout_s: float = 3.0) -> None:
        self.settle_s, self.store_timeout_s = settle_s, store_timeout_s
        self.record: Any = None
        self.trained = False  # a training step began (a failure before it, with a ckpt_path, is in the resume)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.record is None:
            self.record = rank_record.RankRecord.connect(trainer.global_rank, trainer.world_size, self.store_timeout_s)
        rank_record.install(self.record)
        self._enter(rank_record.SETUP, 0)

    def _enter(self, phase: str, step: int) -> None:
        if self.record is not None:
            self.record.enter(phase, step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.trained = True
        self._enter("training_step", trainer.global_step)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._enter("backward", trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._enter("optimizer_step", trainer.global_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._enter("validation", trainer.global_step)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._enter("checkpoint save", trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(rank_record.FINISHED, trainer.global_step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        told = str(exception) + "".join(getattr(exception, "__notes__", []))
        if trainer.ckpt_path and not self.trained and any(word in told for word in UNREADABLE):
            exception.add_note(damaged_checkpoint_note(Path(trainer.ckpt_path)))
        # gloo says "Timed out waiting 5000ms for recv", "Application timeout caused pair closure" or, for a peer
        # whose process died, "Connection closed by peer"; any other failure is not a rank that failed to arrive.
        lost = any(word in told.lower() for word in LOST_PEER)
        if self.record is not None and lost and MARK not in told:
            exception.add_note(self.record.where_others_were(self.settle_s))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        rank_record.install(None)
