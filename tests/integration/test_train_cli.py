"""The Hydra entry point end to end: one run, and a multirun whose jobs start their own ranks."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000",
        "trainer.enable_progress_bar=false"]


def _run(args, cwd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    result = subprocess.run([sys.executable, "-m", "lightning_parallel.train", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def test_single_run_prints_tables_and_writes_logs_and_checkpoint(tmp_path):
    out = _run([*TINY, "strategy=single", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert "lightning_parallel: run" in out and "lightning_parallel: result" in out
    assert "val_loss" in out
    assert list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))


def test_multirun_over_device_counts_runs_each_job_in_its_own_folder(tmp_path):
    out = _run(["-m", *TINY, "strategy=ddp", "trainer.devices=1,2", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path, timeout=600)
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2, out[-3000:]
    for job in jobs:
        assert list((job / "checkpoints").glob("last*.ckpt")), job
    assert "world size" in out and "2 (1 node(s) x 2" in out


def test_bad_layout_fails_before_any_process_starts(tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    result = subprocess.run([sys.executable, "-m", "lightning_parallel.train", *TINY, "trainer.devices=0"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "trainer.devices=0" in result.stderr
