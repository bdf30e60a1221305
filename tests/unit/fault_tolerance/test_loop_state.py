"""A group that heals at start-up continues the healthy group's Lightning loop: one process, no torchft.

A "sender" run captures what a healthy group sends (``resume_state`` at ddp's quorum, before a batch's forward,
or at local_sgd's meeting, at a step's end; the loader position from the end of the step before), a "healer" run
loads it before its fit loop runs (where ``ReplicaGroups.open`` heals) and trains to the end. The healer must
take the sender's next batches, validate and log at the same steps, and end with the very loop state the
uninterrupted run ends with -- which is what every checkpoint it writes claims.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_parallel.fault_tolerance.data_position import skip_batches
from lightning_parallel.fault_tolerance.loop_state import (
    loader_position,
    next_batch,
    restore,
    resume_state,
    set_global_step,
)
from lightning_parallel.resumable_loader import resumable_loader
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

# 8 batches per epoch (the runs cross two epoch ends), a validation every 4 steps (one at each epoch's end)
WIDTH, BATCH, SAMPLES, STEPS = 4, 4, 32, 20


class Steps(Logger):
    """Records the step of every ``train_loss`` Lightning logs."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    name, version = "steps", 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        if "train_loss" in metrics:
            self.steps.append(int(step))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class Data(pl.LightningDataModule):
    """The regression set in a fixed order; ``skip`` batches of the first pass are skipped as the strategy's
    ``process_dataloader`` does for a healed group whose loader keeps no position."""

    def __init__(self, stateful: bool) -> None:
        super().__init__()
        self.stateful, self.skip = stateful, 0
        self.dataset = regression_dataset(SAMPLES, WIDTH)

    def train_dataloader(self) -> DataLoader:
        loader = (resumable_loader(self.dataset, BATCH, shuffle=False) if self.stateful
                  else DataLoader(self.dataset, batch_size=BATCH, drop_last=True))
        assert skip_batches(loader, self.skip) is None
        return loader

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=BATCH)


class Record(pl.Callback):
    """Per optimizer step: the first input of its batch; and the steps at which validation ran."""

    def __init__(self) -> None:
        self.batches: dict[int, float] = {}
        self.validated: list[int] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches[trainer.global_step] = float(batch[0][0, 0])

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.validated.append(trainer.global_step)


class Sender(Record):
    """Captures the state at step ``at`` as a healthy group would send it (``batch_done``: local_sgd's meeting)."""

    def __init__(self, at: int, batch_done: bool) -> None:
        super().__init__()
        self.at, self.batch_done = at, batch_done
        self.loaders: Optional[dict[str, Any]] = None
        self.state: Optional[dict[str, Any]] = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self.batch_done and trainer.global_step == self.at:  # ddp: the quorum before the forward
            self.state = resume_state(trainer, batch_done=False, loaders=self.loaders)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.loaders = loader_position(trainer)  # ReplicaGroups.after_step: before the next batch is drawn
        if self.batch_done and trainer.global_step == self.at:  # local_sgd: the meeting at step at - 1's end
            self.state = resume_state(trainer, batch_done=True, loaders=self.loaders)


class Healer(Record):
    """Loads a sent state where ``ReplicaGroups.open`` does: after the strategy's setup, before the fit loop."""

    def __init__(self, state: dict[str, Any], step: int, data: Data, loop: bool = True) -> None:
        super().__init__()
        self.state, self.step, self.data, self.loop = state, step, data, loop

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        positioned = restore(trainer, self.state) if self.loop else False
        set_global_step(trainer, self.step)
        self.data.skip = 0 if positioned else next_batch(self.state)[1]


def _fit(callback: Record, data: Data) -> tuple[pl.Trainer, Steps]:
    pl.seed_everything(0, verbose=False)
    logger = Steps()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, max_epochs=-1, logger=logger,
                         callbacks=[callback], val_check_interval=4, check_val_every_n_epoch=None,
                         limit_val_batches=1, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ResidualMLP(width=WIDTH, depth=1), datamodule=data)
    return trainer, logger


def _heal(at: int, batch_done: bool, stateful: bool, loop: bool = True):
    sender = Sender(at, batch_done)
    whole, whole_log = _fit(sender, Data(stateful))
    data = Data(stateful)
    healer = Healer(sender.state, at, data, loop)
    healed, healed_log = _fit(healer, data)
    return (sender, whole, whole_log), (healer, healed, healed_log), at


@pytest.mark.parametrize(("at", "batch_done", "stateful"), [
    (5, False, True), (4, False, True), (8, False, True), (13, False, True), (5, False, False),
    (5, True, True), (4, True, True), (8, True, True), (8, True, False)],
    ids=["ddp mid-epoch", "ddp after a validation", "ddp epoch start", "ddp epoch 1", "ddp plain loader",
         "local_sgd mid-epoch", "local_sgd before a validation", "local_sgd epoch end",
         "local_sgd epoch end, plain loader"])
def test_a_healed_loop_continues_the_senders_batches_steps_and_counters(at, batch_done, stateful):
    (sender, whole, whole_log), (healer, healed, healed_log), step = _heal(at, batch_done, stateful)
    assert healed.global_step == whole.global_step == STEPS
    assert healer.batches == {s: b for s, b in sender.batches.items() if s >= step}  # the same next batches
    assert healer.validated == [s for s in sender.validated if s > step]  # validated (and so saved) alike
    assert healed_log.steps == [s for s in whole_log.steps if s >= step]  # logged at the run's steps, not from 0
    assert healed.current_epoch == whole.current_epoch
    assert _position(healed) == _position(whole)  # what a checkpoint written now claims


def test_without_the_loop_state_the_healed_run_counts_from_where_it_rejoined():
    """Negative control: the heal as it was (step count, epoch and loader only) ends elsewhere."""
    (sender, whole, whole_log), (healer, healed, healed_log), step = _heal(5, False, True, loop=False)
    assert healer.batches == {s: b for s, b in sender.batches.items() if s >= step}  # the data alone was right
    assert healed_log.steps[0] == 0 and whole_log.steps[step] == step
    assert healer.validated != [s for s in sender.validated if s > step]
    assert _position(healed) != _position(whole)


def _position(trainer: pl.Trainer) -> dict[str, Any]:
    """What a checkpoint written now claims: the fit loop's entry (every counter, the loader's position), the
    committed steps and the epoch."""
    return {**trainer.fit_loop.state_dict(), "global_step": trainer.global_step, "epoch": trainer.current_epoch}
