"""A refused run leaves no run folder; ckpt_path=last's list finds older runs with a checkpoint (cli/run_folder.py,
cli/run_resume.py)."""

import os
import time

import torch

from lightning_parallel.cli import run_folder
from lightning_parallel.cli.run_folder import claim, discard_refused_folder
from lightning_parallel.cli.run_resume import no_checkpoint_message, recent_runs


def _run(root, name, step=None, age=0.0):
    folder = root / "2026-01-01" / name
    claim(folder, name[-6:], False, {"strategy": "ddp", "experiment": None})
    if step is not None:
        (folder / "checkpoints").mkdir()
        torch.save({"global_step": step}, folder / "checkpoints" / "last.ckpt")
    stamp = time.time() - age
    os.utime(folder / ".lp" / "run.json", (stamp, stamp))
    return folder


def test_the_newest_run_with_a_checkpoint_is_found_behind_many_newer_runs_without_one(tmp_path):
    root = tmp_path / "outputs"
    old = _run(root, "09-00-00.000_ddp_aaaaaa", step=12, age=1000)
    for i in range(7):  # refused or stopped before their first checkpoint, all newer
        _run(root, f"10-00-0{i}.000_ddp_b{i}b{i}b{i}", age=100 - i)
    assert recent_runs(root, {"strategy": "ddp"}, with_checkpoint=True) == [(old, old / "checkpoints" / "last.ckpt")]
    assert len(recent_runs(root, {"strategy": "ddp"})) == 5  # without the filter: the 5 newest, as before
    message = no_checkpoint_message(tmp_path / "new" / "checkpoints", root, {"strategy": "ddp"})
    assert f"lp-train resume={old}    # step 12" in message and "has a checkpoint yet" not in message


def test_a_refused_runs_own_folder_is_removed_with_its_empty_date_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(run_folder._process_run, "generated", "1")
    folder = tmp_path / "outputs" / "2026-01-01" / "10-00-00.000_ddp_abcdef"
    monkeypatch.setitem(run_folder._process_run, "folder", str(folder.resolve()))
    (folder / ".hydra").mkdir(parents=True)
    (folder / "train.log").write_text("refused\n")
    assert discard_refused_folder(folder)
    assert not folder.exists() and not folder.parent.exists() and (tmp_path / "outputs").exists()


def test_a_folder_the_user_named_or_that_holds_a_run_stays(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    (folder / ".hydra").mkdir(parents=True)
    monkeypatch.delitem(run_folder._process_run, "generated", raising=False)
    assert not discard_refused_folder(folder) and folder.exists()  # hydra.run.dir or resume= named it
    monkeypatch.setitem(run_folder._process_run, "generated", "1")
    monkeypatch.setitem(run_folder._process_run, "folder", str((tmp_path / "other").resolve()))
    assert not discard_refused_folder(folder) and folder.exists()  # this process named another folder
    monkeypatch.setitem(run_folder._process_run, "folder", str(folder.resolve()))
    (folder / ".lp").mkdir()
    (folder / ".lp" / "run.json").write_text('{"run_id": "someone"}')
    assert not discard_refused_folder(folder) and folder.exists()  # another run claimed it
    (folder / ".lp" / "run.json").unlink()
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert not discard_refused_folder(folder) and folder.exists()
