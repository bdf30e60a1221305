"""Pipelined validation, test and predict: the same numbers as one process, on every rank."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel.strategies import PipelineParallelStrategy
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow


class _Data(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.dataset = regression_dataset(32, 32)

    def _loader(self):
        return DataLoader(self.dataset, batch_size=8, drop_last=True)

    val_dataloader = test_dataloader = _loader

    def predict_dataloader(self):
        return DataLoader([x for x, _ in self.dataset], batch_size=8)


def _evaluate(rank, world_size):
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         strategy=PipelineParallelStrategy() if world_size > 1 else "auto")
    model = ResidualMLP(width=32, depth=4)
    val = trainer.validate(model, datamodule=_Data(), verbose=False)[0]["val_loss"]
    model = ResidualMLP(width=32, depth=4)
    test = trainer.test(model, datamodule=_Data(), verbose=False)[0]["test_loss"]
    model = ResidualMLP(width=32, depth=4)
    predictions = torch.cat(trainer.predict(model, datamodule=_Data()))
    return val, test, predictions


def test_validation_test_and_predict_match_one_process_on_every_rank():
    (ref_val, _, ref_pred), = run_processes(_evaluate, 1)
    for rank, (val, test, pred) in enumerate(run_processes(_evaluate, 2, timeout=300)):
        assert abs(val - ref_val) < 1e-6, rank
        assert abs(test - ref_val) < 1e-6, rank  # same data, same model
        torch.testing.assert_close(pred, ref_pred, rtol=0, atol=1e-6)


def _fit_then_test(rank, world_size):
    torch.manual_seed(0)
    model = ResidualMLP(width=32, depth=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         enable_checkpointing=False, max_steps=3, limit_val_batches=0, use_distributed_sampler=False,
                         strategy=PipelineParallelStrategy() if world_size > 1 else "auto")

    class Train(_Data):
        def train_dataloader(self):
            return self._loader()

    trainer.fit(model, datamodule=Train())
    return trainer.test(model, datamodule=_Data(), verbose=False)[0]["test_loss"]


def test_fit_then_test_on_the_same_module_reuses_its_split():
    (reference,) = run_processes(_fit_then_test, 1)
    for rank, value in enumerate(run_processes(_fit_then_test, 2, timeout=300)):
        assert abs(value - reference) < 1e-5, rank
