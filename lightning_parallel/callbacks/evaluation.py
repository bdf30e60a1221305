"""The end-of-training evaluation report: inference latency and accuracy, on every strategy.

When training ends (``on_train_end``, while the strategy still holds the parallelised model)
:class:`EvaluationReport` runs the validation and test sets through
``trainer.strategy.predict_step``, times each validation batch, feeds the outputs to the
module's torchmetrics, prints a table on rank 0 and logs the figures to the logger. The
table also shows the training throughput of the run's
:class:`~lightning_parallel.callbacks.ThroughputReport` (when it has one): that callback is
the one measurer, so a run reports a single training-throughput figure.

What a module offers (all optional; duck-typed, as the rest of the protocol):

* ``predict_step(batch, batch_idx)`` -- the model outputs for one ``(inputs, targets)``
  batch. (Under pipeline parallelism the strategy runs the schedule itself and returns the
  outputs on every rank.)
* ``evaluation_metrics() -> dict[name, torchmetrics.Metric]`` -- fresh metrics, updated with
  ``(outputs, targets)`` over a whole split: ``val_<name>``, ``test_<name>``.
* ``evaluation_readout(predict) -> dict[name, value]`` -- anything else worth a line in the
  report, given ``predict(batch) -> outputs`` that runs under the strategy (the GPT recipe
  prints a greedy text sample with it).

And a data module: ``reference_metrics() -> dict[name, float]`` (e.g. the Bayes AUC of a
synthetic click log) is shown beside the model's figures.

Note:
    * Under pipeline parallelism the module's ``validation_step`` is not called, so metrics
      it logs do not exist there; the report does not rely on them. It uses
      ``strategy.predict_step``, which every strategy implements, so every layout reports
      the same figures in the same way.
    * Every rank evaluates the *whole* split with the same batches (no distributed
      sampler): tensor and pipeline groups need identical inputs, and the metrics then need
      no synchronisation. Data-parallel replicas repeat the work; evaluation sets are small.
    * Batches keep the training batch size (pipeline stages are built for one shape): a
      short last batch is padded by repeating its last sample, and the padding is cut from
      the outputs before the metrics see them.
    * Latency is the wall time of one ``predict_step`` per validation batch on this rank
      (including the strategy's collectives), after ``latency_warmup`` batches; the
      validation set is passed repeatedly until ``latency_batches`` batches are timed.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_parallel.adapters import AdapterCache
from lightning_parallel.callbacks.throughput import find_throughput_report, tensor_leaves


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor of a nested batch, keeping its structure."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: _map(item, fn) for key, item in value.items()}
    return value


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor."""
    first = next(tensor_leaves(batch), None)
    if first is None or first.ndim == 0:
        raise ValueError("The batch holds no tensor with a batch dimension: return tensors from the data loader.")
    return int(first.shape[0])


def pad_batch(batch: Any, size: int) -> Any:
    """Pad every tensor of ``batch`` to ``size`` rows by repeating its last row."""

    def pad(tensor: Tensor) -> Tensor:
        missing = size - tensor.shape[0]
        if missing <= 0:
            return tensor
        return torch.cat([tensor, tensor[-1:].expand(missing, *tensor.shape[1:])])

    return _map(batch, pad)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _plain(output: Any) -> Any:
    """Outputs as plain CPU tensors (a DTensor under loss parallelism is gathered)."""
    from torch.distributed.tensor import DTensor

    def convert(tensor: Tensor) -> Tensor:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return tensor.detach().cpu()

    return _map(output, convert)


class EvaluationReport(pl.Callback):
    """Inference latency and the module's accuracy metrics, at the end of training.

    The training throughput it prints is :class:`~lightning_parallel.callbacks.ThroughputReport`'s
    (read, not measured again), and it stays out of :attr:`summary` so that the logged and
    saved metrics hold it once, under ``throughput/*``.

    Args:
        latency_warmup: validation batches run before latency is timed.
        latency_batches: validation batches timed (the set is passed repeatedly if smaller).
        max_eval_batches: cap on batches per split for the metrics (None: the whole split).
        splits: which splits get metrics (``val``, ``test``).
        title: title of the printed table.
        print_table: print the table at the end of training (``lp-train`` sets False and prints
            these rows in its one result table instead).
    """

    def __init__(
        self,
        latency_warmup: int = 2,
        latency_batches: int = 20,
        max_eval_batches: Optional[int] = None,
        splits: tuple[str, ...] = ("val", "test"),
        title: str = "lightning_parallel: evaluation",
        print_table: bool = True,
    ) -> None:
        unknown = set(splits) - {"val", "test"}
        if unknown:
            raise ValueError(f"splits={list(splits)} has {sorted(unknown)}: use 'val' and/or 'test'.")
        self.latency_warmup = latency_warmup
        self.latency_batches = latency_batches
        self.max_eval_batches = max_eval_batches
        self.splits = tuple(splits)
        self.title = title
        self.print_table = print_table
        self._adapter = AdapterCache()
        self.summary: dict[str, float] = {}
        self.readout: dict[str, Any] = {}
        self.latencies: list[float] = []
        self.training_rates: dict[str, float] = {}
        self._batch_size: Optional[int] = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Evaluation batches keep the training batch size (pipeline stages are built for it).
        self._batch_size = self._batch_size or batch_size_of(batch)

    # --- evaluation -------------------------------------------------------------------
    def _loader(self, trainer: pl.Trainer, split: str) -> Optional[DataLoader]:
        """A sequential loader over the whole split, in the training batch size."""
        datamodule = trainer.datamodule
        source = getattr(datamodule, f"{split}_dataloader", None) if datamodule is not None else None
        try:
            loader = source() if callable(source) else (trainer.val_dataloaders if split == "val" else None)
        except Exception:  # noqa: BLE001 - a data module without this split (Lightning raises for a missing hook)
            return None
        if isinstance(loader, (list, tuple)):
            loader = loader[0] if loader else None
        if not isinstance(loader, DataLoader):
            return None
        return DataLoader(loader.dataset, batch_size=self._batch_size, shuffle=False, collate_fn=loader.collate_fn)

    def _predictor(self, trainer: pl.Trainer) -> Callable[[Any], Any]:
        """``predict(batch) -> outputs``: one batch through the strategy, padded to the training shape."""
        strategy = trainer.strategy
        module_type = type(trainer.lightning_module)
        overridden = module_type.predict_step is not pl.LightningModule.predict_step
        own_predict_step = module_type.predict_step if overridden else None

        def predict(batch: Any, batch_idx: int = 0) -> Any:
            size = batch_size_of(batch)
            padded = pad_batch(batch, self._batch_size) if size < self._batch_size else batch
            padded = strategy.batch_to_device(padded)
            if own_predict_step is None:
                # the default predict_step calls self(batch)
                padded = self._adapter(trainer.lightning_module, strategy).split_batch(padded)[0]
            with torch.no_grad():
                outputs = _plain(strategy.predict_step(padded, batch_idx))
            return _map(outputs, lambda t: t[:size] if t.ndim and t.shape[0] == self._batch_size else t)

        return predict

    def _evaluate_split(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, split: str, predict: Callable[[Any], Any]
    ) -> dict[str, float]:
        loader = self._loader(trainer, split)
        factory = getattr(pl_module, "evaluation_metrics", None)
        if loader is None or not callable(factory):
            return {}
        metrics = factory()
        for metric in metrics.values():
            metric.sync_on_compute = False  # every rank saw the whole split
        timed = split == "val"
        for index, batch in enumerate(loader):
            if self.max_eval_batches is not None and index >= self.max_eval_batches:
                break
            start = time.perf_counter()
            outputs = predict(batch, index)
            if timed and index >= self.latency_warmup:
                self.latencies.append(time.perf_counter() - start)
            _, targets = self._adapter(pl_module, trainer.strategy).split_batch(batch)
            for metric in metrics.values():
                metric.update(outputs, targets.cpu())
        return {f"{split}_{name}": float(metric.compute()) for name, metric in metrics.items()}

    def _time_latency(self, trainer: pl.Trainer, predict: Callable[[Any], Any]) -> None:
        """Pass the validation set again until ``latency_batches`` batches are timed."""
        loader = self._loader(trainer, "val")
        if loader is None or len(loader) == 0:
            return
        # Every rank runs the same number of passes: collectives inside predict stay matched.
        while len(self.latencies) < self.latency_batches:
            for index, batch in enumerate(loader):
                start = time.perf_counter()
                predict(batch, index)
                self.latencies.append(time.perf_counter() - start)
                if len(self.latencies) >= self.latency_batches:
                    break

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # GracefulStop's stopped_at: every rank agreed to stop after Ctrl-C/SIGTERM and must exit soon.
        stopped = any(getattr(c, "stopped_at", None) is not None for c in trainer.callbacks)
        if self._batch_size is None or stopped:
            return  # no training batch ran (nothing to measure against), or the run is being stopped
        was_training = pl_module.training
        pl_module.eval()
        try:
            predict = self._predictor(trainer)
            self.latencies = []
            metrics: dict[str, float] = {}
            for split in self.splits:
                metrics.update(self._evaluate_split(trainer, pl_module, split, predict))
            self._time_latency(trainer, predict)
            readout = getattr(pl_module, "evaluation_readout", None)
            self.readout = readout(predict) if callable(readout) else {}
        finally:
            pl_module.train(was_training)
        self.summary = self._summarise(trainer, metrics)
        throughput = find_throughput_report(trainer)
        self.training_rates = throughput.rates() if throughput is not None else {}
        self._report(trainer)

    def _summarise(self, trainer: pl.Trainer, metrics: dict[str, float]) -> dict[str, float]:
        summary: dict[str, float] = {}
        if self.latencies:
            summary["eval/latency_mean_ms"] = 1e3 * sum(self.latencies) / len(self.latencies)
            summary["eval/latency_p95_ms"] = 1e3 * percentile(self.latencies, 95)
            summary["eval/batch_size"] = float(self._batch_size)
        summary.update({f"eval/{name}": value for name, value in metrics.items()})
        reference = getattr(trainer.datamodule, "reference_metrics", None) if trainer.datamodule is not None else None
        if callable(reference):
            summary.update({f"eval/{name}": float(value) for name, value in reference().items()})
        summary.update({f"eval/{k}": float(v) for k, v in self.readout.items() if isinstance(v, (int, float))})
        return summary

    def rows(self) -> list[tuple[str, str]]:
        """The report's rows: training throughput (ThroughputReport's), evaluation figures, text readouts."""
        rows = [(name, f"{value:.4f}") for name, value in self.training_rates.items()]  # ThroughputReport's
        rows += [(name.removeprefix("eval/"), f"{value:.4f}") for name, value in self.summary.items()]
        rows += [(name, str(value)) for name, value in self.readout.items() if not isinstance(value, (int, float))]
        return rows

    def _report(self, trainer: pl.Trainer) -> None:
        if trainer.global_rank != 0:
            return
        from lightning_parallel.runtime.console import print_table

        rows = self.rows()
        if self.print_table:
            print_table(self.title, rows)
        for logger in trainer.loggers:
            logger.log_metrics(self.summary, step=trainer.global_step)
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):  # TensorBoard: the table as text too
                lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
                experiment.add_text("evaluation", "\n".join(lines), global_step=trainer.global_step)
