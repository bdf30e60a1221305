"""Per-step scalars on one process: throughput and memory once per optimizer step (accumulated batches together),
every rank's peak once at the end, and nothing in the run's metrics beside its one throughput figure."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader

from lightning_parallel.callbacks import RunScalars, ThroughputReport


class _Recorder(Logger):
    """Keeps every ``log_metrics`` call: ``[(step, metrics)]``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def steps_of(self, tag: str) -> list[int]:
        return [step for step, metrics in self.calls if tag in metrics]


class _TokenModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def training_step(self, batch, batch_idx):
        inputs, _ = batch
        return self.embed(inputs).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_step_rates_and_memory_are_logged_once_per_optimizer_step_and_every_peak_at_the_end():
    tokens = torch.randint(0, 16, (24, 8), generator=torch.Generator().manual_seed(0))
    recorder, ended = _Recorder(), []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=recorder,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ThroughputReport(warmup_batches=0), RunScalars(at_fit_end=ended.append)])
    trainer.fit(_TokenModel(), DataLoader(list(zip(tokens, tokens)), batch_size=4))  # (inputs, targets) pairs

    assert recorder.steps_of("throughput/step_samples_per_sec") == [1, 2, 3]  # 6 batches, 3 optimizer steps
    assert recorder.steps_of("throughput/step_tokens_per_sec") == [1, 2, 3]
    rates = [m for _, m in recorder.calls if "throughput/step_samples_per_sec" in m]
    assert all(m["throughput/step_tokens_per_sec"] == 8 * m["throughput/step_samples_per_sec"] for m in rates)
    assert recorder.steps_of("memory/max_rss_mib") == [1, 2, 3]
    assert recorder.steps_of("memory/rank0/max_rss_mib") == [3]
    assert recorder.steps_of("grad_norm") == []  # Lightning's own strategy keeps no norm: none is computed for it
    assert ended == [trainer]  # the final write ran in on_fit_end, while the logger was open
    assert "throughput/step_samples_per_sec" not in trainer.callback_metrics
