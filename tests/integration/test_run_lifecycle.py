"""The edges of a run through ``lp-train``: folders that cannot collide, resume that resumes, Ctrl-C that
stops every rank within seconds, and a sweep that survives a failed job (issue 22).

Each test spawns as few runs as it can and checks several things on each (the runs are tiny: gpt_tiny,
a few steps, trainer=cpu_test).
"""

import csv
import json
import math
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.integration.lp_train_runs import logged_scalars, lp_train, lp_train_env, ok

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000"]
FOLDER = re.compile(r"\d\d-\d\d-\d\d\.\d{3}_(?P<label>[\w.-]+)_(?P<id>[0-9a-f]{6})")


def _lp_train(args, cwd, timeout=300):
    return lp_train(args, cwd, timeout)


def _run_folders(cwd):
    return sorted(p for p in (cwd / "outputs").glob("*/*") if (p / ".lp" / "run.json").is_file())


def test_two_runs_started_in_the_same_second_finish_in_their_own_folders_with_their_own_configs(tmp_path):
    # Two 2-process runs, started together from one folder, told apart by their seeds.
    args = [*TINY, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=2", "logger=none", "callbacks=none"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda seed: _lp_train([*args, f"seed={seed}"], tmp_path), (101, 202)))
    for result in results:
        ok(result)
    folders = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(folders) == 2, folders
    seeds = set()
    for folder in folders:
        match = FOLDER.fullmatch(folder.name)
        assert match and match["label"] == "ddp", folder.name
        owner = yaml.safe_load((folder / ".lp" / "run.json").read_text())
        assert owner["run_id"] == match["id"]
        # The children's configuration: its own file, named by its own run id, with its own seed.
        rank_config = (folder / ".lp" / match["id"] / "config.yaml").read_text()
        assert rank_config.startswith(f"# lightning_parallel run {match['id']}\n")
        seed = yaml.safe_load(rank_config)["seed"]
        assert yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())["seed"] == seed
        assert (folder / "metrics.json").is_file() and (folder / "rank1.log").is_file()
        seeds.add(seed)
    assert seeds == {101, 202}


def test_ckpt_path_last_without_a_checkpoint_fails_and_resume_continues_in_the_same_folder(tmp_path):
    args = [*TINY, "strategy=single", "callbacks.evaluation=null"]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_lp_train, [*args, "trainer.max_steps=4"], tmp_path)
        reference = pool.submit(_lp_train, [*args, "trainer.max_steps=8", "hydra.run.dir=reference"], tmp_path)
        out = ok(first.result())
        ok(reference.result())
    (run,) = _run_folders(tmp_path)
    # A 4-step run (interval 3 in cpu_test) validates, reports its checkpoint and logs to train.log.
    assert "every 2 batches" in out and "fresh start" in out
    assert re.search(r"val_loss\s+│\s+\d", out) and "checkpoint (last)" in out
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert "val_loss" in json.loads((run / "metrics.json").read_text())["metrics"]
    assert "Trainer.fit` stopped" in (run / "train.log").read_text()

    fresh = _lp_train([*args, "ckpt_path=last"], tmp_path, timeout=120)
    assert fresh.returncode == 2, fresh.stderr[-3000:]
    assert f"lp-train resume={run}    # step 4" in fresh.stderr and "Traceback" not in fresh.stderr
    assert len(_run_folders(tmp_path)) == 1  # the refused run claimed no folder

    out = ok(_lp_train([f"resume={run}", "trainer.max_steps=8"], tmp_path))
    assert "resumed from step 4 of " in out  # the path follows (the table may fold it)
    assert len(_run_folders(tmp_path)) == 1 and "step8" in " ".join(p.name for p in (run / "checkpoints").iterdir())
    # One TensorBoard run, steps continuous, the same losses as the uninterrupted run.
    resumed = logged_scalars(run / "tensorboard", "train_loss")
    uninterrupted = logged_scalars(tmp_path / "reference" / "tensorboard", "train_loss")
    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) == 8, (sorted(resumed), sorted(uninterrupted))
    assert max(abs(resumed[s] - uninterrupted[s]) for s in resumed) < 1e-5


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except OSError:
        return False


def test_sigint_stops_every_rank_of_a_pipeline_run_within_seconds_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "lightning_parallel.cli.train", *TINY, "strategy=pipeline", "trainer.devices=2",
               "trainer.max_steps=100000", "model.max_steps=100000", "logger=none", "callbacks.evaluation=null",
               f"hydra.run.dir={run}"]
    log = open(tmp_path / "out.txt", "w+")
    launcher = subprocess.Popen(command, cwd=tmp_path, env=lp_train_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "lightning_parallel: pipeline split" not in (tmp_path / "out.txt").read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)  # a few steps
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
        ranks = [int(p) for p in children.split()]
        assert len(ranks) == 1
        sent = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = (tmp_path / "out.txt").read_text()
    print(f"SIGINT to exit: {took:.2f} s")
    assert code == 130 and took < 10, (code, took, out[-3000:])
    assert not [pid for pid in ranks if _alive(pid)], "a rank outlived the launcher"
    assert "SIGINT: stopping all 2 local ranks after the current step" in out
    saved = re.search(r"saved (\S+) \(step (\d+)\)\. Continue with: lp-train resume=(\S+)", out)
    assert saved and Path(saved[1]) == run / "checkpoints" / "last-stop.ckpt" and int(saved[2]) >= 1, out[-3000:]
    # Lightning validates when training stops early, and ModelCheckpoint(save_last) then writes last-v1.ckpt beside
    # a last.ckpt it did not write: neither happens, the stop is the newest checkpoint.
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not [n for n in names if n.startswith("last-v")], names
    assert max((run / "checkpoints").iterdir(), key=lambda p: p.stat().st_mtime).name == "last-stop.ckpt"
    assert Path(saved[3]) == run

    # Resumed from the stop, the run ends where an uninterrupted one does (the schedule's length pinned
    # by model.max_steps, so the shorter trainer.max_steps changes nothing but where training ends).
    end = int(saved[2]) + 2
    with ThreadPoolExecutor(2) as pool:
        resumed = pool.submit(_lp_train, [f"resume={run}", f"trainer.max_steps={end}"], tmp_path)
        uninterrupted = pool.submit(_lp_train, [*(a for a in command[3:-1] if not a.startswith("trainer.max_steps=")),
                                                   f"trainer.max_steps={end}", "hydra.run.dir=reference"], tmp_path)
        assert f"resumed from step {saved[2]} of " in ok(resumed.result())
        ok(uninterrupted.result())
    final = [
        json.loads((folder / "metrics.json").read_text())["metrics"]["train_loss"]
        for folder in (run, tmp_path / "reference")
    ]
    print(f"train_loss at step {end}: resumed after SIGINT {final[0]:.7f}, uninterrupted {final[1]:.7f}")
    assert abs(final[0] - final[1]) < 1e-5, final


def test_a_sweep_with_a_failing_job_writes_its_row_prints_the_table_and_exits_with_the_count(tmp_path):
    result = _lp_train(["-m", *TINY, "strategy=single", "trainer.max_steps=2", "logger=none", "callbacks=none",
                        "data.path=null,no_such_corpus", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    with open(tmp_path / "sweep" / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["status"] for r in rows] == ["ok", "failed: data.path=no_such_corpus does not exist "
                                           f"(looked from {tmp_path}): give an existing file or folder, or "
                                           "data.path=null for the built-in data"], rows
    assert math.isfinite(float(rows[0]["val_loss"]))
    assert "sweep summary (2 jobs)" in out and "1 of 2 jobs failed" in out and "Traceback" not in out


def test_forked_and_spawned_ranks_train_the_same_losses_and_keep_their_own_logs(tmp_path):
    """On CPU lp-train forks ranks 1..N-1 after its imports and checks (cli/forked_rank.py); LP_START_METHOD=spawn
    starts new interpreters as before. Both give the same losses bit for bit, and each rank logs to its own file."""
    args = [*TINY, "strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1",
            "strategy.microbatches=2", "trainer.devices=2", "trainer.max_steps=3", "callbacks.evaluation=null"]
    with ThreadPoolExecutor(2) as pool:
        runs = {method: pool.submit(lp_train, [*args, f"hydra.run.dir={method}"], tmp_path, 300,
                                    lp_train_env(LP_START_METHOD=method)) for method in ("fork", "spawn")}
        for result in runs.values():
            ok(result.result())
    losses = {method: logged_scalars(tmp_path / method / "tensorboard", "train_loss") for method in runs}
    assert sorted(losses["fork"]) == [0, 1, 2] and losses["fork"] == losses["spawn"]
    for method in runs:
        assert "GLOBAL_RANK: 1" in (tmp_path / method / "rank1.log").read_text()
        assert "GLOBAL_RANK: 1" not in (tmp_path / method / "train.log").read_text()
