"""The Hydra entry point end to end: one run, and a multirun whose jobs start their own ranks."""

import csv
import json
import os

import pytest
import yaml

from tests.integration.forked_cli import forked_or_spawned

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000",
        "trainer.enable_progress_bar=false"]


def _run(args, cwd, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    result = forked_or_spawned("lightning_parallel.cli.train", [*args], cwd, env, timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def test_single_run_prints_tables_and_writes_logs_and_checkpoint(tmp_path):
    out = _run([*TINY, "strategy=single", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert "lightning_parallel: run" in out and "lightning_parallel: result" in out
    assert "val_loss" in out
    assert list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    events = list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    # The effective hyperparameters reach TensorBoard's HParams tab with the final metrics ...
    raw = b"".join(e.read_bytes() for e in events)
    assert b"_hparams_/session_start_info" in raw and b"hp/val_loss" in raw and b"effective/global_batch_size" in raw
    # ... hparams.yaml, the saved effective config, and metrics.json for sweep summaries.
    assert "effective" in (tmp_path / "run" / "tensorboard" / "hparams.yaml").read_text()
    effective = yaml.safe_load((tmp_path / "run" / ".hydra" / "effective.yaml").read_text())
    assert effective["data"]["batch_size"] == 4 and effective["scaling"]["effective"]["global_batch_size"] == 4
    assert effective["run"]["reproduce"].startswith("scaling=fixed_global_batch scaling.reference.global_batch_size=4 ")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["strategy"] == "single" and "val_loss" in metrics["metrics"]


def test_multirun_over_device_counts_runs_each_job_in_its_own_folder(tmp_path):
    out = _run(
        ["-m", *TINY, "strategy=ddp", "trainer.devices=1,2", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path, timeout=600
    )
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2, out[-3000:]
    for job in jobs:
        assert list((job / "checkpoints").glob("last*.ckpt")), job
    assert "world size" in out and "2 (1 node(s) x 2" in out
    # The sweep ends with its summary (lightning_parallel.cli.sweep_summary), one row per job.
    with open(tmp_path / "sweep" / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["devices"], r["global_batch_size"], r["status"]) for r in rows] == [("1", "4", "ok"), ("2", "8", "ok")]
    assert "sweep summary (2 jobs)" in out


def test_bad_layout_fails_before_any_process_starts(tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    result = forked_or_spawned("lightning_parallel.cli.train", [*TINY, "trainer.devices=0"], tmp_path, env, 120)
    assert result.returncode != 0
    assert "trainer.devices=0" in result.stderr
