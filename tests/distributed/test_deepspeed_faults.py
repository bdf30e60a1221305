"""DeepSpeed under two faults the fault matrix found: a rank hung in backward fails the other within the strategy's
timeout (naming it), and a NaN gradient stops the run instead of DeepSpeed skipping the update silently."""

import time
from pathlib import Path

import pytest

from benchmarks.fault_trial import train_rank
from lightning_parallel.testing import DistributedRunError, run_processes
from lightning_parallel.testing.fault_points import FaultPoint

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
LAYOUT = "DeepSpeed ZeRO-2"


def test_a_rank_hung_in_backward_fails_the_other_within_the_timeout_naming_it(tmp_path):
    # Before: ZeRO's clone of the world group took torch's 30-minute default; rank 0 still waited after 40 s.
    stamp = tmp_path / "stamp"
    point = FaultPoint("hang", "backward", rank=1, step=3, stamp=str(stamp))
    with pytest.raises(DistributedRunError, match="rank 1 is in backward of step 3 too but did not time out"):
        run_processes(train_rank, 2, LAYOUT, str(tmp_path), 5.0, point, timeout=120)
    assert time.time() - float(stamp.read_text()) < 5.0 + 8


def test_a_nan_gradient_stops_every_rank_naming_the_step(tmp_path):
    # Before: DeepSpeed skipped step 3's update silently and training went on (losses 5.7e-3 off at the end).
    point = FaultPoint("nan", "backward", rank=1, step=3)
    with pytest.raises(DistributedRunError, match="Non-finite gradients at optimizer step 3 .*DeepSpeed skipped"):
        run_processes(train_rank, 2, LAYOUT, str(tmp_path), 10.0, point, timeout=120)
    assert Path(tmp_path, "step=2.ckpt").exists()
