"""``lp-train`` with ``strategy.fault_tolerance`` on one node: it starts a lighthouse and two replica groups (one
process each: the layouts inside a group are tests/distributed/fault_tolerance's), one group's rank is killed at
step 4, lp-train restarts that group, it heals from the other, and the command ends with exit 0 and both groups'
results."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

RUN = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000",
       "trainer.enable_progress_bar=false", "strategy=hybrid", "strategy.pipeline_parallel_size=1",
       "strategy.tensor_parallel_size=1", "trainer.devices=2", "trainer.max_steps=12", "trainer.max_epochs=-1",
       "logger=none",
       "+strategy.fault_tolerance.replicas=2", "+strategy.fault_tolerance.timeout=20",
       "+callbacks.faults._target_=lightning_parallel.testing.faults.FaultInjection",
       "+callbacks.faults.fail_at=[1:0:4]",
       # 3 s per step while alone: group 0 is still training when group 1 is back (about 11 s after its loss here)
       "+callbacks.hold._target_=lightning_parallel.testing.faults.HoldWhileDegraded", "+callbacks.hold.seconds=3"]


def test_lp_train_restarts_a_lost_replica_group_which_heals_from_the_other(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    result = subprocess.run([sys.executable, "-m", "lightning_parallel.cli.train", *RUN, f"hydra.run.dir={tmp_path}"],
                            env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "lp-train: lighthouse at" in output
    assert "replica group 1 exited with code" in output and "restarting it (1/3)" in output
    # The restarted group heals from group 0 mid-run (every group heals at step 0 too: that line says step 0)
    healed = [int(step) for step in re.findall(r"\[replica group 1\] recovered step (\d+)", output)]
    assert any(step > 4 for step in healed), (healed, output[-6000:])
    for folder in ("group0", "group1-restart1"):  # the restarted group runs in a folder of its own
        summary = json.loads((tmp_path / folder / "metrics.json").read_text())
        assert summary, folder
