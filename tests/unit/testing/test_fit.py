"""fit_recording_losses: one loss per training batch, the same on a rerun (fixed order, fixed seed)."""

import lightning.pytorch as pl

from lightning_parallel.testing.fit import fit_recording_losses
from lightning_parallel.testing.models import ResidualMLP, regression_dataset


def _fit(**trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    return fit_recording_losses(
        ResidualMLP(width=8, depth=2), "auto", 1, regression_dataset(32, 8), 4, 3, **trainer_kwargs
    )


def test_one_loss_per_batch_including_accumulated_ones_and_repeatable():
    losses = _fit(accumulate_grad_batches=2)
    assert len(losses) == 3 * 2
    assert losses == _fit(accumulate_grad_batches=2)
