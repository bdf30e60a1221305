"""A rank that hangs in a step: the ranks that time out name it, the phase it never reached and where it was."""

import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import DDPStrategy

from lightning_parallel.callbacks.rank_record import RankRecorder
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import DistributedRunError, run_processes
from lightning_parallel.testing.fit import quiet_trainer
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow
TIMEOUT_S = 5


class _HangBeforeOptimizerStep(pl.Callback):
    """Rank ``rank`` sleeps at step 2 after its backward, writing when it started to ``stamp``."""

    def __init__(self, rank, stamp):
        self.rank, self.stamp = rank, stamp

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == self.rank and trainer.global_step == 2:
            Path(self.stamp).write_text(str(time.time()))
            time.sleep(120)


def _fit(rank, world_size, strategy, stamp, **trainer_kwargs):
    # The hang comes first among the callbacks: the record then shows the phase the rank passed last.
    trainer = quiet_trainer(world_size, strategy, 4, [_HangBeforeOptimizerStep(world_size - 1, stamp), RankRecorder()],
                            **trainer_kwargs)
    trainer.fit(ResidualMLP(), datamodule=FixedOrderData(regression_dataset(64, 32), batch_size=8))


def _error_and_delay(tmp_path, world_size, strategy, **trainer_kwargs):
    stamp = tmp_path / "hang_started"
    with pytest.raises(DistributedRunError) as error:
        run_processes(_fit, world_size, strategy, str(stamp), timeout=120, **trainer_kwargs)
    return str(error.value), time.time() - float(stamp.read_text())


def test_data_by_pipeline_ranks_name_the_hung_rank_and_the_phase_within_the_timeout(tmp_path):
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    message, delay = _error_and_delay(tmp_path, 4, strategy, gradient_clip_val=1.0)
    assert "timed out after 0:00:05 in optimizer_step" in message
    assert "rank 3 never reached optimizer_step of step 2 (last seen: " in message, message
    assert delay < TIMEOUT_S + 6, delay


def test_lightning_ddp_timeout_gets_the_same_sentence_as_a_note(tmp_path):
    message, delay = _error_and_delay(tmp_path, 2, DDPStrategy(timeout=timedelta(seconds=TIMEOUT_S)))
    assert "rank 1 never reached backward of step 3 (last seen: backward of step 2, " in message, message
    assert delay < TIMEOUT_S + 6, delay
