"""Keep the data order exact when a run resumes: at an epoch's end, and mid-epoch on a loader without a position.

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

    Mid-epoch, a loader with ``state_dict`` restores its own position (``resumable_loader``'s is global, so it
    reshards). A plain ``DataLoader`` has none: Lightning warns "not resumable" and the resumed epoch restarts at
    its first batch, training on batches the run already took. This callback saves the position as samples of the
    epoch's global stream (batches done x samples per batch x data-parallel ranks, read from the loader Lightning
    prepared) and, at ``on_train_start`` of the resume, starts each rank's sampler at its share of that position,
    before the epoch draws its first index -- at any data-parallel size. A loader that draws indices while its
    iterator is made (``num_workers > 0``) or has no sampler (an ``IterableDataset``) cannot be positioned there:
    one line at start-up says so and what to do.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Optional

import lightning.pytorch as pl
from typing_extensions import override

from lightning_parallel._compat import drop_loader_position, epoch_end_loop_progress, fit_loop_state
from lightning_parallel.resumable_loader import skip_samples
from lightning_parallel.runtime.log import rank_zero_warn


def _reset_for_next_epoch(progress: Any) -> dict[str, Any]:
    fresh = deepcopy(progress)
    fresh.reset_on_run()
    return fresh.state_dict()


def _replicas(sampler: Any) -> int:
    """How many data-parallel ranks share the epoch through ``sampler`` (1 for a sampler that does not shard)."""
    return int(getattr(sampler, "num_replicas", 1) or 1)


def _stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class ExactDataResume(pl.Callback):
    """Makes every resume continue on the batches the uninterrupted run would have taken next.

    Add it to the Trainer's callbacks (the suite's default ``conf/callbacks`` does, and ``lp-train`` adds it when a
    config leaves it out). At an epoch's end it makes checkpoints resume at the next epoch's first batch; mid-epoch
    it positions loaders that keep no position of their own (the module docstring).
    """

    def __init__(self) -> None:
        self._samples_per_batch: Optional[int] = None  # restored: global samples per loader batch of the saving run

    @override
    def state_dict(self) -> dict[str, Any]:
        """Global samples per training batch (per-rank batch x data-parallel ranks), or nothing when unknown."""
        trainer = getattr(self, "_trainer", None)
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        batch_size = getattr(loader, "batch_size", None)
        if batch_size is None:
            return {}
        return {"samples_per_batch": int(batch_size) * _replicas(getattr(loader, "sampler", None))}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keeps the saving run's samples per batch for ``on_train_start``."""
        self._samples_per_batch = state_dict.get("samples_per_batch")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() takes no trainer: the loader it describes is found through it

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # done in this epoch, as restored
        loader = trainer.train_dataloader
        if not trainer.ckpt_path or batches <= 0 or _stateful(loader):
            return  # a fresh start, an epoch's start, or a loader that restored its own position
        if self._samples_per_batch is None or getattr(loader, "num_workers", 0) > 0:
            rank_zero_warn(
                f"lightning_parallel: resuming {batches} batches into epoch {trainer.current_epoch} with a training "
                "loader that keeps no position ("
                + ("it loads with worker processes, which draw indices before a callback can place them" if
                   self._samples_per_batch is not None else "the checkpoint records no samples per batch")
                + "): the epoch restarts at its first batch. Use lightning_parallel.resumable_loader (its position "
                "is checkpointed and reshards), or resume from a checkpoint written at an epoch's end.")
            return
        served, replicas = batches * self._samples_per_batch, _replicas(loader.sampler)
        notice = skip_samples(loader, served // replicas) if served % replicas == 0 else (
            f"its {served} samples served do not split over {replicas} data-parallel ranks, so no rank split "
            f"continues exactly: resume with a data-parallel size that divides {served}.")
        if notice is not None:
            rank_zero_warn(f"lightning_parallel: resuming {batches} batches into epoch {trainer.current_epoch}: "
                           f"{notice}")

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
