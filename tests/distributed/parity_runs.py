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
        dataset: ``"regression"`` (width-32 vectors) or ``"text"`` (byte windows of 16 tokens).
    """
    pl.seed_everything(0)
    trainer_kwargs = dict(trainer_kwargs or {})
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    model = model_factory() if model_factory else ResidualMLP(width=32, depth=4, optimizer=optimizer)
    if callable(strategy) and not isinstance(strategy, (str, pl.strategies.Strategy)):
        strategy = strategy()
    samples = regression_dataset(SAMPLES, 32) if dataset == "regression" else text_dataset(SAMPLES, 16)
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
