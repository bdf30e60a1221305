"""Quiet Trainers for tests, and fitting a model for a few steps while recording the loss of every batch
(the body of a parity run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_parallel.testing.models import FixedOrderData
from lightning_parallel.testing.parity import LossHistory


def quiet_trainer(
    devices: int, strategy: Any, steps: int, callbacks: list, accelerator: str = "cpu", **trainer_kwargs: Any
) -> pl.Trainer:
    """A Trainer that writes nothing (no logger, checkpoints, progress bar or model summary) and leaves
    the data order to the data module (Lightning's distributed sampler off).

    Args:
        devices: processes (the harness's world size) or devices.
        strategy: a strategy object or a registered name.
        steps: optimizer steps (``max_steps``).
        callbacks: the Trainer's callbacks (e.g. a :class:`LossHistory`).
        accelerator: ``"cpu"`` (gloo) or ``"cuda"``.
        **trainer_kwargs: further Trainer arguments (``precision``, ``accumulate_grad_batches``, clipping, ...).
    """
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )


def fit_recording_losses(
    model: pl.LightningModule,
    strategy: Any,
    devices: int,
    dataset: Any,
    batch_size: int,
    steps: int,
    **trainer_kwargs: Any,
) -> list[float]:
    """Fit ``model`` for ``steps`` optimizer steps; return the global-batch loss of every batch.

    The data is served in a fixed order (:class:`FixedOrderData`, with Lightning's own
    distributed sampler off), so any two layouts see the same global batches and their
    losses can be compared number for number. The Trainer runs on CPU and writes nothing
    (no logger, checkpoints, progress bar or model summary).

    Args:
        model: the LightningModule to fit (the caller keeps it, to inspect it afterwards).
        strategy: a strategy object or a registered name.
        devices: processes (the harness's world size).
        dataset: the samples, served in order.
        batch_size: samples per data-parallel rank per step.
        steps: optimizer steps (the Trainer's ``max_steps``).
        **trainer_kwargs: further Trainer arguments (``accumulate_grad_batches``, clipping, ...).

    Returns:
        :attr:`LossHistory.losses`: one global-batch mean per training batch (so
        ``steps * accumulate_grad_batches`` of them), the same list on every rank.
    """
    history = LossHistory()
    trainer = quiet_trainer(devices, strategy, steps, [history], **trainer_kwargs)
    trainer.fit(model, datamodule=FixedOrderData(dataset, batch_size=batch_size))
    return history.losses


def fit_regression_epochs(
    world_size: int,
    strategy: Any,
    epochs: int,
    *,
    batches: int,
    global_batch: int,
    optimizer: str = "adamw",
    module: Optional[pl.LightningModule] = None,
    data_parallel: Optional[int] = None,
    callbacks: Sequence[pl.Callback] = (),
    ckpt_path: Optional[str] = None,
    seed: int = 0,
) -> tuple[list[float], pl.Trainer]:
    """Fit the residual MLP for whole epochs, recording every batch's global loss (checkpoint tests' fits).

    Every epoch serves the same ``batches`` global batches of ``global_batch`` regression samples in a fixed
    order, so a run saved after epoch 0 and resumed trains on the batches of one uninterrupted run.

    Args:
        world_size: processes (the harness's world size).
        strategy: a strategy object or a registered name.
        epochs: ``max_epochs`` (on resume: the total, counting the epochs in the checkpoint).
        batches: training batches per epoch.
        global_batch: samples per step over all data-parallel ranks.
        optimizer: the MLP's optimizer (``"adamw"`` or ``"sgd"``).
        module: fit this module instead of a fresh ``ResidualMLP(optimizer=optimizer, seed=seed)``.
        data_parallel: data-parallel size; by default the strategy's own (``strategies.resolve.resolve_layout``),
            which Lightning's ``ModelParallelStrategy`` does not report.
        callbacks: further callbacks; checkpointing is on only when some are given (e.g. a ``ModelCheckpoint``).
        ckpt_path: resume from this checkpoint.
        seed: the fresh module's initialisation seed; resume with another one, so that weights that did not
            come from the checkpoint show as a loss gap. The data and Lightning's seed are always 0.

    Returns:
        The global-batch loss of every batch this fit trained, and the Trainer.
    """
    from lightning_parallel.strategies.resolve import resolve_layout
    from lightning_parallel.testing.models import ResidualMLP, regression_dataset

    pl.seed_everything(0, verbose=False)
    history = LossHistory()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs,
                         limit_train_batches=batches, limit_val_batches=0, logger=False,
                         enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[history, *callbacks])
    dp = data_parallel if data_parallel is not None else resolve_layout(strategy, world_size).data_parallel
    data = FixedOrderData(regression_dataset(batches * global_batch, 32), batch_size=global_batch // dp)
    trainer.fit(module or ResidualMLP(optimizer=optimizer, seed=seed), datamodule=data, ckpt_path=ckpt_path)
    return history.losses, trainer


def optimizer_step_counts(trainer: pl.Trainer) -> list[int]:
    """The distinct ``step`` counts in the first optimizer's state (one value after a correct resume)."""
    return sorted({int(state["step"]) for state in trainer.optimizers[0].state.values() if "step" in state})
