"""A SIGTERM sent to one rank directly (as torchrun, SLURM and Kubernetes send it) stops every rank at one step."""

from pathlib import Path

import pytest

from benchmarks.fault_trial import train_rank
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.fault_points import FaultPoint

pytestmark = pytest.mark.slow


def test_a_sigterm_to_one_rank_inside_a_pipeline_step_stops_both_ranks_after_one_step_with_a_checkpoint(tmp_path):
    # Before: Lightning's SIGTERM handler, registered after on_fit_start, broadcast from inside the handler and the
    # other rank timed out (CollectiveTimeout after the strategy's 10 s).
    point = FaultPoint("sigterm", "forward", rank=1, step=3)
    results = run_processes(train_rank, 2, "pipeline", str(tmp_path), 10.0, point, timeout=120,
                            env={"LP_STOP_GRACE_S": "30"})
    assert [r["stopped_at"] for r in results] == [4, 4]
    assert Path(tmp_path, "last-stop.ckpt").is_dir()
