"""A stalled rank makes the others fail after the strategy's timeout, with an error naming rank, position and phase."""

import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest

from lightning_parallel.strategies import PipelineParallelStrategy
from lightning_parallel.testing import DistributedRunError, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow


class _StallRankOne(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            time.sleep(30)


def _fit(rank, world_size):
    trainer = pl.Trainer(accelerator="cpu", devices=world_size,
                         strategy=PipelineParallelStrategy(timeout=timedelta(seconds=5)),
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[_StallRankOne()])
    trainer.fit(ResidualMLP(), datamodule=FixedOrderData(regression_dataset(64, 32), batch_size=16))


def test_a_stalled_rank_fails_the_others_with_rank_and_phase_named():
    start = time.monotonic()
    with pytest.raises(
        DistributedRunError,
        match=r"Rank 0 \(data, pipeline, tensor = \(0, 0, 0\)\) timed out after 0:00:05 in training_step",
    ):
        run_processes(_fit, 2, timeout=120)
    assert time.monotonic() - start < 60  # it did not wait for the stalled rank
