"""Stop every rank at the same optimizer step after SIGINT/SIGTERM, with a checkpoint to resume from.

See :mod:`lightning_parallel.runtime.signals` for the whole stop: the signal marks this process, and
the ranks all-reduce their marks (one element, MAX) at agreed optimizer steps, so they all stop
after the same step, write ``last-stop.ckpt`` together (a collective under sharded strategies) and
leave ``fit`` normally, without the validation Lightning runs when training is stopped early.

The agreement is a collective a raw training loop does not have. It runs after each of the first
:data:`PROBE_STEPS` steps, whose slowest step time the ranks agree on with it; from then on every
``interval`` steps, ``interval`` being the steps that take ``agree_every_s`` seconds (at least 1): a
stop is seen within about that long, and a fast step pays no collective of its own. It replaces the one
Lightning's loop runs before every step (a broadcast of rank 0's SIGTERM flag, dropped while this callback's
signal handlers hold SIGTERM), so a steady step under ``lp-train`` runs only the model's collectives.

Nothing written after the stop claims a later position. Lightning still ends the fit after the stop: it marks the
epoch complete, steps epoch-interval LR schedulers, and ``ModelCheckpoint(save_last=True)`` then writes ``last.ckpt``
from ``on_train_end`` (0.6 s later, at the same ``global_step``, in epoch 1 "completed" where the stop was 13 of 14
batches into epoch 0). Resumed, such a file skipped the rest of the epoch and trained on the next epoch's shuffle
(0.18-0.43 off under context 2). Every checkpoint written at the stop's step after it therefore carries the stop's
own loop progress, epoch and LR-scheduler state (:meth:`GracefulStop.on_save_checkpoint`), whoever writes it.

Note:
    The name is not ``last.ckpt``: a ``ModelCheckpoint(save_last=True)`` that finds a ``last.ckpt``
    it did not write saves its own next one as ``last-v1.ckpt``. ``resume=`` and ``ckpt_path=last``
    take the newest ``last*.ckpt`` (:func:`lightning_parallel.cli.run_resume.last_checkpoint`).
"""

from __future__ import annotations

import os
import time
from copy import deepcopy
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.runtime import signals

PROBE_STEPS = 3  # steps after which the ranks agree on each, timing them, before the interval is set
# The parts of a Lightning checkpoint that the end of a stopped fit moves on; a later save at the stop's step gets
# the stop's own copy (the weights, optimizer state and other callbacks' states do not move once training stopped).
POSITION_KEYS = ("loops", "epoch", "lr_schedulers")


class GracefulStop(pl.Callback):
    """Ends training at the first agreed optimizer step after any rank was asked to stop, and saves it.

    Args:
        checkpoint_dir: where ``last-stop.ckpt`` is written (the run's ``checkpoints`` folder).
        agree_every_s: about how often (seconds of training) the ranks agree on a stop; the module docstring.
            Default ``$LP_STOP_AGREE_S``, else 1 s; 0 agrees after every step (a stop lands on the next step).
    """

    def __init__(self, checkpoint_dir: str, agree_every_s: Optional[float] = None) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.agree_every_s = float(os.environ.get("LP_STOP_AGREE_S", "1.0")) if agree_every_s is None else agree_every_s
        self.saved: Optional[Path] = None
        self.stopped_at: Optional[int] = None
        self.interval: Optional[int] = None  # steps between agreements, once the probe steps have run
        self._last_step = -1
        self._steps = 0
        self._slowest = 0.0  # the slowest step seen while probing (the first step, which warms up, not counted)
        self._step_ended: Optional[float] = None
        self._stop_position: Optional[dict[str, Any]] = None  # POSITION_KEYS as the stop checkpoint wrote them
        self._saving_stop = False

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's SIGTERM handler broadcasts from inside the handler (a collective at a random
        # point of one rank's program); the suite's handlers take SIGTERM back, so Lightning's flag is never set
        # and its per-step broadcast of that flag is a collective for nothing: dropped (the agreement here stands in).
        signals.take_handlers()
        _compat.drop_per_step_sigterm_broadcast(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its own SIGTERM handler after on_fit_start (in the Trainer's run), so the handlers are taken
        # back here too: a SIGTERM sent to a rank directly (torchrun, SLURM, Kubernetes) ran Lightning's handler, a
        # broadcast from inside the handler, and the other ranks timed out instead of stopping (the fault matrix).
        signals.take_handlers()

    def _any_rank_asked(self, trainer: pl.Trainer) -> bool:
        """At an agreed step: whether any rank was asked to stop (during the probe steps also the slowest step)."""
        probing = self.interval is None
        values = [1.0 if self._asked(trainer) else 0.0, self._slowest if probing else 0.0]
        asked = torch.tensor(values, device=trainer.strategy.root_device)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(asked, op=torch.distributed.ReduceOp.MAX)
        if probing and self._steps >= PROBE_STEPS:
            self.interval = max(1, int(self.agree_every_s / max(float(asked[1]), 1e-6)))
        return bool(asked[0].item())

    @staticmethod
    def _replicas(trainer: pl.Trainer) -> Any:
        """The strategy's fault-tolerant replica groups exchanging a stop vote every step (``mode=ddp``), or None."""
        replicas = getattr(trainer.strategy, "replica_groups", None)
        return replicas if replicas is not None and replicas.options.mode == "ddp" else None

    def _asked(self, trainer: pl.Trainer) -> bool:
        """This rank's vote: a run-wide stop under fault tolerance counts only as the replica groups voted it at this
        step, so every group stops after the same one (a signal to one group alone stops that group only)."""
        replicas = self._replicas(trainer)
        if replicas is not None and signals.run_wide_stop():
            return bool(replicas.run_stop_agreed)
        return signals.stop_requested() or bool(replicas is not None and replicas.run_stop_agreed)

    def _agreement_due(self, trainer: pl.Trainer) -> bool:
        """Whether this step is one the ranks agree at (the same answer on every rank: it counts steps only; every
        step under fault tolerance, whose groups vote a stop every step and count steps from where they joined)."""
        self._steps += 1
        return self.interval is None or self._steps % self.interval == 0 or self._replicas(trainer) is not None

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
        now = time.monotonic()
        if self._step_ended is not None and self.interval is None:
            self._slowest = max(self._slowest, now - self._step_ended)
        self._step_ended = now
        if not self._agreement_due(trainer) or not self._any_rank_asked(trainer):
            return
        path = self.checkpoint_dir / "last-stop.ckpt"
        self._saving_stop = True
        try:
            trainer.save_checkpoint(str(path))
            writer = getattr(trainer.strategy, "async_writer", None)
            if writer is not None:  # async_save: the stop's checkpoint is complete before the stop is announced
                writer.wait()
        finally:
            self._saving_stop = False
        self.saved, self.stopped_at = path, trainer.global_step
        if shutdown is not None:
            shutdown.saved = str(path)
        trainer.should_stop = True
        trainer.limit_val_batches = 0  # Lightning validates when stopped early: not while the user waits for Ctrl-C

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Records the stop checkpoint's position; gives it to every later checkpoint at the stop's step."""
        if self._saving_stop:
            self._stop_position = deepcopy({k: checkpoint[k] for k in POSITION_KEYS if k in checkpoint})
        elif self._stop_position is not None and trainer.global_step == self.stopped_at:
            checkpoint.update(deepcopy(self._stop_position))
