"""A NaN on one rank stops every rank before the update, or skips the step everywhere."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.callbacks import NonFiniteGuard
from lightning_parallel.strategies import PipelineParallelStrategy
from lightning_parallel.testing import DistributedRunError, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow


def _fit_with_nan(rank, world_size, strategy, action):
    """``strategy``: ``ddp`` (a local check), ``pipeline`` (a flag all-reduced) or ``pipeline+clip`` (the verdict
    from the clipping's global norm)."""
    clip = 0.5 if strategy.endswith("+clip") else None
    pl.seed_everything(0)
    data = regression_dataset(64, 32)
    data.tensors[0][2 * 16 + 9, 3] = float("nan")  # one sample of batch 2, in rank 1's data-parallel shard
    guard = NonFiniteGuard(action)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size,
                         strategy=strategy if strategy == "ddp" else PipelineParallelStrategy(),
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[guard],
                         gradient_clip_val=clip)
    model = ResidualMLP()
    dp = 2 if strategy == "ddp" else 1
    trainer.fit(model, datamodule=FixedOrderData(data, batch_size=16 // dp))
    return guard.skipped_steps, all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("strategy", ["ddp", "pipeline+clip"])
def test_stop_raises_on_every_rank_naming_the_step(strategy):
    with pytest.raises(DistributedRunError, match="Non-finite gradients at optimizer step 2"):
        run_processes(_fit_with_nan, 2, strategy, "stop", timeout=300)


@pytest.mark.parametrize("strategy", ["ddp", "pipeline", "pipeline+clip"])
def test_skip_drops_the_step_everywhere_and_keeps_weights_finite(strategy):
    for skipped, finite in run_processes(_fit_with_nan, 2, strategy, "skip", timeout=300):
        assert skipped == [2] and finite
