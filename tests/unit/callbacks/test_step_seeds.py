"""A run with dropout, stopped and resumed from its checkpoint, trains on the same masks as the uninterrupted run
(StepSeeds), where without it the first resumed step is already other draws (the negative control)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.callbacks import ExactDataResume, StepSeeds
from lightning_parallel.callbacks.step_seeds import step_seed
from lightning_parallel.testing import LossHistory, max_abs_difference

STEPS, SAVED_AT = 8, 3


class DropoutRegressor(pl.LightningModule):
    """A two-layer regressor with dropout between the layers and a random augmentation in its step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.01 * torch.randn_like(x)  # randomness outside a module too
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 1, generator=generator))


def _fit(root: Path, seeds: bool, max_steps: int, ckpt_path=None, extra=(), accumulate=1) -> LossHistory:
    history = LossHistory()
    pl.seed_everything(0 if ckpt_path is None else 123)  # the resuming command's seed must not matter
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1, limit_val_batches=1, val_check_interval=2,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, accumulate_grad_batches=accumulate,
        callbacks=[history, ExactDataResume(), *([StepSeeds()] if seeds else []), *extra],
    )  # fmt: skip
    data = _data()
    trainer.fit(DropoutRegressor(), DataLoader(data, batch_size=8, shuffle=False), DataLoader(data, batch_size=8),
                ckpt_path=ckpt_path)
    return history


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_resumed_run_with_dropout_draws_the_uninterrupted_runs_masks(tmp_path, accumulate):
    saver = ModelCheckpoint(dirpath=tmp_path, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=SAVED_AT, save_top_k=-1)
    full = _fit(tmp_path, True, STEPS, extra=[saver], accumulate=accumulate)
    resumed = _fit(tmp_path, True, STEPS, ckpt_path=str(tmp_path / f"step{SAVED_AT}.ckpt"), accumulate=accumulate)
    done = SAVED_AT * accumulate  # batches the checkpoint had trained
    assert len(resumed.losses) == len(full.losses) - done
    assert max_abs_difference(resumed.losses, full.losses[done:]) == 0.0


def test_without_step_seeds_the_resumed_masks_are_other_draws(tmp_path):
    """The negative control: Lightning alone resumes the weights and data exactly, not the random streams."""
    saver = ModelCheckpoint(dirpath=tmp_path, filename="step{step}", auto_insert_metric_name=False,
                            every_n_train_steps=SAVED_AT, save_top_k=-1)
    full = _fit(tmp_path, False, STEPS, extra=[saver])
    resumed = _fit(tmp_path, False, STEPS, ckpt_path=str(tmp_path / f"step{SAVED_AT}.ckpt"))
    assert max_abs_difference(resumed.losses[:1], full.losses[SAVED_AT:SAVED_AT + 1]) > 1e-4


def test_neighbouring_batches_get_unrelated_seeds_from_the_run_seed():
    seeds = {step_seed(0, step, micro) for step in range(50) for micro in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert step_seed(0, 1, 0) != step_seed(1, 0, 0)  # base and step are not simply added
