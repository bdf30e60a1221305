"""A rank killed mid-training under torchrun --max-restarts=1: the job restarts from the last complete
(mid-epoch) checkpoint, trains on exactly the batches an uninterrupted run trains on, and ends with its losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parallel.runtime.ports import free_port
from tests.integration.forked_cli import run_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUN = [
    "model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000",
    "strategy=pipeline", "trainer.devices=2", "+trainer.limit_train_batches=5",
    "trainer.max_steps=12", "trainer.max_epochs=-1",
    # Checkpoints every 2 steps: with 5 batches an epoch most of them land mid-epoch, where only
    # the data loader's saved position (StatefulDataLoader) keeps the data order intact.
    "callbacks.model_checkpoint.monitor=null", "callbacks.model_checkpoint.filename='step{step}'",
    "+callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
    "ckpt_path=last",
]  # fmt: skip
KILL_STEP = 7  # last complete checkpoint: step 6, batch 1 of epoch 1


def _recorded(run_dir: Path) -> list[str]:
    return ["+callbacks.record._target_=lightning_parallel.testing.BatchHistory",
            f"+callbacks.record.folder={run_dir / 'batches'}", f"hydra.run.dir={run_dir}"]


def _uninterrupted(run_dir: Path) -> subprocess.CompletedProcess:
    """The reference: the same run through lp-train's own launcher (forked from the test session's fork server:
    two new interpreters less; forked and spawned ranks train alike, tests/integration/test_run_lifecycle.py)."""
    args = [*(a for a in RUN if a != "ckpt_path=last"), *_recorded(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}
    return run_command("lightning_parallel.cli.train", args, ROOT, env, 600)


def _torchrun(run_dir: Path, extra: list[str]) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", "lightning_parallel.cli.train", *RUN, *extra, *_recorded(run_dir),
    ]  # fmt: skip
    # pytorch#135712: torchrun's c10d rendezvous shares its TCPStore with the workers' process
    # group, and a restarted attempt can read the dead attempt's addresses (gloo then fails
    # with "connectFullMesh ... Connection refused", 1 run in 3 here). Not sharing it fixes that.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _batches(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "batches" / f"rank{rank}.jsonl").read_text().splitlines()]


def test_killed_rank_restarts_from_mid_epoch_checkpoint_with_same_data_and_losses(tmp_path):
    clean = _uninterrupted(tmp_path / "clean")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    fault = ["+callbacks.fault._target_=tests.integration.faults.KillRankAtStep", "+callbacks.fault.rank=1",
             f"+callbacks.fault.step={KILL_STEP}"]
    faulty = _torchrun(tmp_path / "faulty", fault)
    log = faulty.stdout + faulty.stderr
    assert faulty.returncode == 0, log[-5000:]
    assert "exitcode: -9" in log  # rank 1 really died of SIGKILL
    assert "Restoring states from the checkpoint" in log  # and the restart resumed

    for rank in (0, 1):
        expected = [(b["step"], b["batch"]) for b in _batches(tmp_path / "clean", rank)]
        records = _batches(tmp_path / "faulty", rank)
        restarted = [(b["step"], b["batch"]) for b in records if b["attempt"] == 1]
        assert restarted[0][0] == KILL_STEP - 1, restarted  # resumed from the step-6 checkpoint, mid-epoch
        # The first attempt up to the checkpoint, then the restart: exactly the uninterrupted run's batches.
        before = [(b["step"], b["batch"]) for b in records if b["attempt"] == 0 and b["step"] < restarted[0][0]]
        assert before + restarted == expected, (rank, before + restarted, expected)

    expected = json.loads((tmp_path / "clean" / "metrics.json").read_text())["metrics"]
    got = json.loads((tmp_path / "faulty" / "metrics.json").read_text())["metrics"]
    for key in ("train_loss", "val_loss"):
        assert abs(got[key] - expected[key]) < 1e-5, (key, got[key], expected[key])
