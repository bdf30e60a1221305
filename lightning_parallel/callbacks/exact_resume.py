"""Keep the data order exact when a run resumes from a checkpoint written at the end of an epoch.

Note:
    With a resumable train loader (:func:`lightning_parallel.resumable_loader.resumable_loader`,
    or any loader with ``state_dict``), Lightning 2.6 checkpoints the loader's position and
    restores it -- exact mid-epoch. Two checkpoints at an epoch's end still resume wrongly
    (both seen here with shuffled data-parallel runs bounded by ``max_steps``):

    * written on the epoch's last batch (``every_n_train_steps`` landing there, or at the
      epoch-end validation): Lightning saves "all batches of epoch e served", moves on to
      epoch e+1 and restores that position into it, so e+1 skips its first batches (a run
      resumed at step 4 of 4-batch epochs trained on batches 4-5 of the next epoch instead
      of 0-1). The loop decides the epoch is over only after restoring the loader.
    * written after ``fit`` stopped at ``max_steps`` at an epoch's end
      (``trainer.save_checkpoint``): a ``max_steps``-bounded run always resumes as
      "restarting", which keeps the finished epoch's batch counters, so the next epoch
      counts as already complete and is skipped whole (it trained on epoch e+2's data).

    Both are fixed on the save side, by writing what the next epoch's start would hold: no
    loader position (the next epoch begins at its first batch) and, once the epoch is fully
    finished, the per-epoch progress counters reset as Lightning resets them when an epoch
    starts. Checkpoints written mid-epoch are left untouched.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_parallel._compat import drop_loader_position, epoch_end_loop_progress, fit_loop_state


def _reset_for_next_epoch(progress: Any) -> dict[str, Any]:
    fresh = deepcopy(progress)
    fresh.reset_on_run()
    return fresh.state_dict()


class ExactDataResume(pl.Callback):
    """Makes checkpoints written at the end of an epoch resume at the next epoch's first batch.

    Add it to the Trainer's callbacks (the suite's default ``conf/callbacks`` does) when the run
    saves checkpoints by step (``ModelCheckpoint(every_n_train_steps=...)``), at validation ends,
    or with ``trainer.save_checkpoint`` after ``fit``; it leaves mid-epoch checkpoints unchanged.
    """

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return
        fit_state = fit_loop_state(checkpoint)
        if fit_state is None:
            return
        drop_loader_position(fit_state)
        epoch = trainer.fit_loop.epoch_progress.current
        if epoch.processed == epoch.ready:  # the epoch is over, its end hooks included
            for key, progress in epoch_end_loop_progress(trainer).items():
                fit_state[key] = _reset_for_next_epoch(progress)
