"""Training throughput measured from the batches themselves, on every strategy: the run's one figure.

:class:`ThroughputReport` is the only place that times training batches. Other reports
(:class:`~lightning_parallel.callbacks.EvaluationReport`) show its figure instead of
measuring their own, so a run reports one training throughput, not two that disagree.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_parallel.adapters import AdapterCache


def tensor_leaves(value: Any) -> Iterator[Tensor]:
    """The tensors of a (nested) tuple/list/dict batch, depth first."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensor_leaves(item)


def data_parallel_size(strategy: Any) -> int:
    """Number of data-parallel replicas of a Lightning strategy (ranks that see different samples)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    if kwargs and "num_replicas" in kwargs:
        return int(kwargs["num_replicas"])
    return int(getattr(strategy, "world_size", 1) or 1)


def find_throughput_report(trainer: pl.Trainer) -> Optional[ThroughputReport]:
    """The Trainer's :class:`ThroughputReport`, or ``None`` when it has none."""
    return next((c for c in trainer.callbacks if isinstance(c, ThroughputReport)), None)


def _counts(inputs: Any, dp: int) -> tuple[int, int]:
    """Global samples and tokens of one batch's inputs on ``dp`` data-parallel replicas."""
    # Several inputs (e.g. dense + sparse features): the first tensor counts the samples.
    first = next(tensor_leaves(inputs), None)
    samples = first.shape[0] * dp if first is not None else 0
    # Tokens: inputs that are one integer tensor are token ids (language models).
    tokens = inputs.numel() * dp if isinstance(inputs, Tensor) and not inputs.is_floating_point() else 0
    return samples, tokens


class ThroughputReport(pl.Callback):
    """Times every training batch and reports global samples/s and tokens/s, per optimizer step and for the run.

    Only the time inside training batches counts (validation and checkpointing are
    excluded); the first ``warmup_batches`` are skipped so start-up does not bias the figure.
    Samples are counted from the batch's inputs times the data-parallel size; tokens
    are counted when the inputs are integer token ids.

    Note:
        On CUDA the callback synchronises the device at both ends of every training batch.
        Kernels run asynchronously: without the sync the host clock measures kernel
        launches, and a batch's device work spills into the next batch (or into the
        validation that follows), so the figure would flatter the model. Synced, each
        batch is charged exactly its own work; the price is the overlap of the next
        batch's host-side start with this batch's last kernels, small beside a training
        step. CPU runs need no sync.

        Lightning's ``ThroughputMonitor`` does not fit: it multiplies a rank's samples by the world size, which
        counts a batch once per pipeline stage and tensor shard (the suite's ranks outside the data axis see the
        same samples), and its rates are over a window of ``window_size`` batches, not the step that just ran.

    Args:
        warmup_batches: batches ignored at the start.
        log_every_n_steps: how often (in optimizer steps) to log the step's rates to the loggers (0: never).
    """

    def __init__(self, warmup_batches: int = 5, log_every_n_steps: int = 1) -> None:
        self.warmup_batches = warmup_batches
        self.log_every_n_steps = log_every_n_steps
        self.batch_times: list[float] = []
        self.samples = 0
        self.tokens = 0
        self._start: Optional[float] = None
        self._seen = 0
        self._fit_start: Optional[float] = None
        self.summary: dict[str, float] = {}
        self._adapter = AdapterCache()
        self._step: tuple[float, int, int] = (0.0, 0, 0)  # seconds, samples, tokens of the step being accumulated
        self._logged_step = -1

    @staticmethod
    def _sync(trainer: pl.Trainer) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged_step = trainer.global_step  # after a resume's restore

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        elapsed = time.perf_counter() - self._start
        self._seen += 1
        inputs, _ = self._adapter(pl_module, trainer.strategy).split_batch(batch)
        samples, tokens = _counts(inputs, data_parallel_size(trainer.strategy))
        self._log_step(trainer, elapsed, samples, tokens)
        if self._seen <= self.warmup_batches:
            return
        self.batch_times.append(elapsed)
        self.samples += samples
        self.tokens += tokens

    def _log_step(self, trainer: pl.Trainer, elapsed: float, samples: int, tokens: int) -> None:
        """Log the rates of the optimizer step this batch ended (its accumulated batches together), warm-up included:
        ``throughput/step_samples_per_sec`` and ``throughput/step_tokens_per_sec``, straight to the loggers (they stay
        out of the run's metrics, whose one throughput is :meth:`rates`)."""
        self._step = (self._step[0] + elapsed, self._step[1] + samples, self._step[2] + tokens)
        step = trainer.global_step
        if step == self._logged_step:
            return  # an accumulation micro-batch: its optimizer step has not run yet
        seconds, samples, tokens = self._step
        self._step, self._logged_step = (0.0, 0, 0), step
        if not self.log_every_n_steps or step % self.log_every_n_steps or seconds <= 0:
            return
        rates = {"throughput/step_samples_per_sec": samples / seconds}
        if tokens:
            rates["throughput/step_tokens_per_sec"] = tokens / seconds
        for logger in trainer.loggers:
            logger.log_metrics(rates, step=step)

    def rates(self) -> dict[str, float]:
        """``throughput/samples_per_sec`` (and ``tokens_per_sec`` for token inputs) so far.

        Empty before any timed batch.
        """
        total = sum(self.batch_times)
        if not total:
            return {}
        rates = {"throughput/samples_per_sec": self.samples / total}
        if self.tokens:
            rates["throughput/tokens_per_sec"] = self.tokens / total
        return rates

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = {
            **self.rates(),
            "throughput/median_batch_ms": (
                1e3 * statistics.median(self.batch_times) if self.batch_times else float("nan")
            ),
            "time/fit_seconds": time.perf_counter() - (self._fit_start or time.perf_counter()),
        }
