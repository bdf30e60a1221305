"""Quiet Trainers for tests, and fitting a model for a few steps while recording the loss of every batch
(the body of a parity run)."""

from __future__ import annotations

from typing import Any

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
