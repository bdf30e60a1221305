"""Shared rank functions for parity tests: fit a protocol model under a strategy and return its losses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from lightning_parallel.testing.fit import fit_recording_losses
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

SAMPLES = 256


def text_dataset(samples: int, seq_len: int):
    """The first ``samples`` byte windows of the standard-library corpus (real text, fixed)."""
    from torch.utils.data import Subset

    from examples.nlp.data import ByteWindows, load_corpus

    train, _ = load_corpus(None, max_bytes=samples * seq_len * 2, val_every=10)
    return Subset(ByteWindows(train, seq_len), range(samples))


def padded_text_dataset(samples: int, seq_len: int):
    """Byte windows right-padded to unequal lengths: after a per-sample valid length (seeded, at least 2
    tokens) the inputs are 0 and the targets -100, so token counts differ between samples and ranks."""
    import torch
    from torch.utils.data import TensorDataset

    windows = text_dataset(samples, seq_len)
    inputs = torch.stack([windows[i][0] for i in range(samples)])
    targets = torch.stack([windows[i][1] for i in range(samples)])
    valid = torch.randint(2, seq_len + 1, (samples,), generator=torch.Generator().manual_seed(7))
    pad = torch.arange(seq_len)[None, :] >= valid[:, None]
    return TensorDataset(inputs.masked_fill(pad, 0), targets.masked_fill(pad, -100))


def tiny_gpt(**overrides):
    """A GPT small enough for multi-process tests (width 32, 2 blocks, 4 heads, 16 tokens)."""
    from functools import partial

    import torch

    from examples.nlp.model import GPT

    torch.manual_seed(0)
    kwargs = {"seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, "optimizer": partial(torch.optim.AdamW, lr=1e-2),
              "warmup_steps": 0}
    return GPT(**{**kwargs, **overrides})


def fit_losses(
    rank: int,
    world_size: int,
    strategy: Any,
    global_batch: int,
    data_parallel: int,
    steps: int = 10,
    optimizer: str = "sgd",
    trainer_kwargs: dict | None = None,
    model_factory: Callable[[], pl.LightningModule] | None = None,
    dataset: str = "regression",
) -> list[float]:
    """Fit ``steps`` optimizer steps of a tiny model; return the global-batch loss of every batch.

    Args:
        rank: this process's rank (from the harness).
        world_size: number of processes.
        strategy: a strategy object, a registered name, or a zero-argument factory.
        global_batch: samples per optimizer step across all data-parallel ranks.
        data_parallel: data-parallel size of the layout (divides the batch).
        steps: optimizer steps.
        optimizer: ``"sgd"`` or ``"adamw"``.
        trainer_kwargs: extra Trainer arguments (accumulation, clipping, ...).
        model_factory: builds the model (default: ResidualMLP width 32, depth 4).
        dataset: ``"regression"`` (width-32 vectors), ``"text"`` (byte windows of 16 tokens) or ``"text_padded"``
            (the same, right-padded to unequal lengths with ``-100`` targets).
    """
    pl.seed_everything(0)
    trainer_kwargs = dict(trainer_kwargs or {})
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    model = model_factory() if model_factory else ResidualMLP(width=32, depth=4, optimizer=optimizer)
    if callable(strategy) and not isinstance(strategy, (str, pl.strategies.Strategy)):
        strategy = strategy()
    samples = {"regression": lambda: regression_dataset(SAMPLES, 32), "text": lambda: text_dataset(SAMPLES, 16),
               "text_padded": lambda: padded_text_dataset(SAMPLES, 16)}[dataset]()
    batch_size = global_batch // data_parallel
    losses = fit_recording_losses(model, strategy, world_size, samples, batch_size, steps, **trainer_kwargs)
    assert len(losses) == steps * accumulate
    return losses


def fit_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Run several :func:`fit_losses` cases one after another in the same processes.

    Spawning ranks costs seconds each on a small machine; one launch serves many cases.

    Args:
        rank: this process's rank.
        world_size: number of processes.
        cases: name -> keyword arguments of :func:`fit_losses` (without rank/world_size).
    """
    return {name: fit_losses(rank, world_size, **kwargs) for name, kwargs in cases.items()}


def fit_text_epochs(model_factory, world_size, strategy, epochs, *, batches, global_batch, data_parallel,
                    callbacks=(), ckpt_path=None):
    """Fit ``model_factory()`` on the first ``batches`` global batches of padded byte windows for whole epochs
    (a checkpoint at an epoch's end resumes onto the batches of one uninterrupted run); returns every batch's
    global loss.

    Args:
        model_factory: builds the model (seeded).
        world_size: processes.
        strategy: a strategy object or ``"auto"``.
        epochs: ``max_epochs`` (on resume: the total).
        batches: global batches per epoch.
        global_batch: samples per step over the data-parallel ranks.
        data_parallel: data-parallel ranks (the per-rank batch is ``global_batch / data_parallel``).
        callbacks: further callbacks (checkpointing is on only with some).
        ckpt_path: resume from this checkpoint.
    """
    from torch.utils.data import Subset

    from lightning_parallel.testing.models import FixedOrderData
    from lightning_parallel.testing.parity import LossHistory

    pl.seed_everything(0, verbose=False)
    history = LossHistory()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs,
                         limit_val_batches=0, logger=False, enable_checkpointing=bool(callbacks),
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[history, *callbacks], gradient_clip_val=0.5)
    samples = Subset(padded_text_dataset(256, 16), range(batches * global_batch))
    trainer.fit(model_factory(), datamodule=FixedOrderData(samples, batch_size=global_batch // data_parallel),
                ckpt_path=ckpt_path)
    return history.losses


def run_recorded_cases(rank: int, world_size: int, fit: Callable[..., Any], cases: dict) -> dict[str, object]:
    """Rank function: ``fit(*case, world_size=world_size)`` for every case in turn; a case that raises is recorded as
    its error text (all ranks raise alike), so the other cases of the launch still run and each test reports its own.

    Args:
        rank: this process's rank.
        world_size: number of processes.
        fit: a module-level function of the test (``fit(*case, world_size=...) -> result``).
        cases: name -> the positional arguments of ``fit``.
    """
    out: dict[str, object] = {}
    for name, case in cases.items():
        try:
            out[name] = fit(*case, world_size=world_size)
        except Exception as error:  # noqa: BLE001 - reported by the test of that case
            out[name] = f"{type(error).__name__}: {error}"
    return out

