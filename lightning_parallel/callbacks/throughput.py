"""Training throughput measured from the batches themselves, on every strategy."""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_parallel.protocol import split_batch


def data_parallel_size(strategy: Any) -> int:
    """Number of data-parallel replicas of a Lightning strategy (ranks that see different samples)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if kwargs and "num_replicas" in kwargs:
        return int(kwargs["num_replicas"])
    return int(getattr(strategy, "world_size", 1) or 1)


class ThroughputReport(pl.Callback):
    """Times every training batch and reports global samples/s and tokens/s.

    Only the time inside training batches counts (validation and checkpointing are
    excluded); the first ``warmup_batches`` are skipped so start-up does not bias the figure.
    Samples are counted from the batch's inputs times the data-parallel size; tokens
    are counted when the inputs are integer token ids.

    Args:
        warmup_batches: batches ignored at the start.
        log_every_n_steps: how often to log ``throughput/*`` to the logger (0: never).
    """

    def __init__(self, warmup_batches: int = 5, log_every_n_steps: int = 50) -> None:
        self.warmup_batches = warmup_batches
        self.log_every_n_steps = log_every_n_steps
        self.batch_times: list[float] = []
        self.samples = 0
        self.tokens = 0
        self._start: Optional[float] = None
        self._seen = 0
        self._fit_start: Optional[float] = None
        self.summary: dict[str, float] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self._start
        self._seen += 1
        if self._seen <= self.warmup_batches:
            return
        self.batch_times.append(elapsed)
        inputs, _ = split_batch(pl_module, batch)
        dp = data_parallel_size(trainer.strategy)
        if not isinstance(inputs, torch.Tensor):  # several inputs (e.g. dense + sparse features): count the first
            leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)]
            inputs = leaves[0] if leaves else None
            if inputs is not None:
                self.samples += inputs.shape[0] * dp
            inputs = None
        if isinstance(inputs, torch.Tensor):
            self.samples += inputs.shape[0] * dp
            if not inputs.is_floating_point():
                self.tokens += inputs.numel() * dp
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0:
            pl_module.log_dict(self._rates(), rank_zero_only=True)

    def _rates(self) -> dict[str, float]:
        total = sum(self.batch_times)
        if not total:
            return {}
        rates = {"throughput/samples_per_sec": self.samples / total}
        if self.tokens:
            rates["throughput/tokens_per_sec"] = self.tokens / total
        return rates

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = {
            **self._rates(),
            "throughput/median_batch_ms": 1e3 * statistics.median(self.batch_times) if self.batch_times else float("nan"),
            "time/fit_seconds": time.perf_counter() - (self._fit_start or time.perf_counter()),
        }
