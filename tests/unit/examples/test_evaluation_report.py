"""EvaluationReport on one process: padding, percentiles, and a whole report after a short fit.

The training throughput of a run is ThroughputReport's alone; the report shows it without measuring.
"""

from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from examples.vision.data import ImageDataModule
from examples.vision.model import ViT
from lightning_parallel.callbacks import EvaluationReport, ThroughputReport
from lightning_parallel.callbacks.evaluation import batch_size_of, pad_batch, percentile
from lightning_parallel.callbacks.throughput import tensor_leaves
from lightning_parallel.cli.train import fit_metrics


def test_pad_batch_repeats_the_last_row_of_every_tensor():
    batch = ((torch.arange(6.0).view(3, 2), torch.tensor([1, 2, 3])), torch.tensor([0, 1, 0]))
    padded = pad_batch(batch, 5)
    assert batch_size_of(padded) == 5
    assert padded[0][1].tolist() == [1, 2, 3, 3, 3] and padded[0][0][-1].tolist() == [4.0, 5.0]


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([], 95) != percentile([], 95)  # NaN


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="use 'val' and/or 'test'"):
        EvaluationReport(splits=("train",))


class _Digits(ImageDataModule):
    def reference_metrics(self):
        return {"chance_accuracy": 0.1}


def test_report_after_a_short_fit_covers_every_sample(tmp_path, capsys):
    torch.manual_seed(0)
    model = ViT(d_model=16, n_layer=1, n_head=2, optimizer=partial(torch.optim.AdamW, lr=1e-2))
    data = _Digits(batch_size=64)  # 180 val / 360 test samples: the last batches are padded
    seen = []
    metrics = model.evaluation_metrics
    model.evaluation_metrics = lambda: {name: _Counting(metric, seen) for name, metric in metrics().items()}
    report, throughput = EvaluationReport(latency_batches=6), ThroughputReport(warmup_batches=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=pl.loggers.TensorBoardLogger(tmp_path),
                         enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                         callbacks=[report, throughput])
    trainer.fit(model, datamodule=data)
    summary = report.summary
    assert {"eval/latency_mean_ms", "eval/latency_p95_ms", "eval/val_accuracy",
            "eval/test_accuracy", "eval/chance_accuracy"} <= set(summary)
    assert report.training_rates == {"throughput/samples_per_sec": throughput.rates()["throughput/samples_per_sec"]}
    assert len(report.latencies) >= 6 and summary["eval/latency_p95_ms"] >= summary["eval/latency_mean_ms"] * 0.5
    assert sorted(seen) == sorted([180, 360])  # every sample once, padding removed
    assert model.training  # the report puts the module back in training mode
    out = capsys.readouterr().out
    assert "lightning_parallel: evaluation" in out and "throughput/samples_per_sec" in out
    assert list(tmp_path.rglob("events.out.tfevents.*"))


def test_a_run_reports_exactly_one_training_throughput(tmp_path):
    """Both reports of conf/callbacks/default.yaml together: the run's metrics hold one samples/s figure."""
    torch.manual_seed(0)
    model = ViT(d_model=16, n_layer=1, n_head=2, optimizer=partial(torch.optim.AdamW, lr=1e-2))
    data = _Digits(batch_size=64)
    throughput = ThroughputReport(warmup_batches=2, log_every_n_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0,
                         callbacks=[EvaluationReport(latency_batches=2, splits=("val",)), throughput])
    trainer.fit(model, datamodule=data)
    metrics = fit_metrics(trainer, data)
    assert [key for key in metrics if "samples_per_sec" in key] == ["throughput/samples_per_sec"]
    assert metrics["throughput/samples_per_sec"] == pytest.approx(64 * 4 / sum(throughput.batch_times))
    assert not [key for key in metrics if key.startswith("eval/train")]


def test_tensor_leaves_walks_nested_batches_depth_first():
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
    assert [t.numel() for t in tensor_leaves(((a, {"x": b, "y": "label"}), [c], 7))] == [2, 3, 1]


class _Counting:
    """Wraps a metric and records how many samples each split fed it."""

    def __init__(self, metric, seen):
        self.metric, self.seen, self.count, self.sync_on_compute = metric, seen, 0, True

    def update(self, outputs, targets):
        assert outputs.shape[0] == targets.shape[0]
        self.count += targets.shape[0]
        self.metric.update(outputs, targets)

    def compute(self):
        self.seen.append(self.count)
        return self.metric.compute()
