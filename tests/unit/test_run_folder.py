"""Run folders, the per-run rank configuration, resume lookup and the validation schedule, without processes."""

import json
import os
import re
import threading

import pytest
import torch
from omegaconf import OmegaConf

from lightning_parallel.cli import run_folder
from lightning_parallel.cli.preflight import ConfigError, check_trainer_overrides, unknown_trainer_key
from lightning_parallel.cli.run_folder import claim, read_owner, verify_rank_config, write_rank_config
from lightning_parallel.cli.run_resume import checkpoint_step, last_checkpoint, no_checkpoint_message, resume_overrides
from lightning_parallel.cli.run_start import validation_schedule
from lightning_parallel.cli.sweep_summary import job_row, record_failure


def test_folder_names_carry_time_label_and_id_and_resume_keeps_the_folder(monkeypatch):
    monkeypatch.setattr(run_folder, "_process_run", {})
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv(run_folder.ENV_RUN_ID, raising=False)
    name = run_folder.run_folder("outputs", None, None, "pipeline")
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d\.\d{3}_pipeline_[0-9a-f]{6}", name), name
    assert run_folder.run_folder("outputs", None, None, "pipeline") == name  # read twice, one folder
    assert run_folder.run_folder("outputs", None, "nlp_gpt", "ddp").split("_", 1)[1].startswith("nlp_gpt_")
    assert run_folder.run_folder("outputs", "outputs/old/run", None, "ddp") == "outputs/old/run"
    monkeypatch.setattr(run_folder, "_process_run", {})
    other = run_folder.run_folder("outputs", None, None, "pipeline")
    assert other != name  # another process (a fresh id) never gets the same folder
    monkeypatch.setattr(run_folder, "_process_run", {})
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_folder.run_folder("outputs", None, None, "ddp") == "outputs/slurm4242_ddp"  # same on every task


def test_claim_is_atomic_and_refuses_another_runs_folder_unless_resuming(tmp_path):
    results = []

    def contender(identity):
        try:
            results.append(claim(tmp_path, identity, False, {"strategy": "ddp"})["run_id"])
        except ValueError as error:
            results.append(str(error))

    threads = [threading.Thread(target=contender, args=(f"id{i}",)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    winners = [r for r in results if r.startswith("id")]
    assert len(winners) == 1 and read_owner(tmp_path)["run_id"] == winners[0]
    refusals = [r for r in results if not r.startswith("id")]
    assert len(refusals) == 7 and all(f"resume={tmp_path}" in r for r in refusals)
    assert claim(tmp_path, "later", True, {})["run_id"] == winners[0]  # resume: the owner stays
    assert (tmp_path / ".lp" / "resume-later.json").is_file()
    # A folder without an owner record but with another run's checkpoints is refused as well.
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "last.ckpt").write_text("x")
    with pytest.raises(ValueError, match="already holds checkpoints"):
        claim(other, "new", False, {})
    assert not (other / ".lp" / "run.json").exists()


def test_rank_configuration_is_checked_against_its_run_id_and_hash(tmp_path):
    folder, sha = write_rank_config(tmp_path, "abc123", "seed: 1\n")
    assert folder == tmp_path / ".lp" / "abc123"
    verify_rank_config(folder, "abc123", sha)
    with pytest.raises(RuntimeError, match="not the one written for run other"):
        verify_rank_config(folder, "other", sha)
    (folder / "config.yaml").write_text((folder / "config.yaml").read_text().replace("seed: 1", "seed: 2"))
    with pytest.raises(RuntimeError, match="refusing to start"):
        verify_rank_config(folder, "abc123", sha)
    with pytest.raises(RuntimeError, match="unreadable"):
        verify_rank_config(tmp_path / "missing", "abc123", sha)


def test_resume_lookup_lists_recent_runs_with_their_step_and_command(tmp_path):
    root = tmp_path / "outputs"
    runs = (("10-00-00.000_ddp_aaaaaa", 7), ("11-00-00.000_ddp_bbbbbb", None), ("12-00-00.000_tensor_cccccc", 3))
    for name, step in runs:
        run = root / "2026-01-01" / name
        claim(run, name[-6:], False, {"strategy": name.split("_")[1], "experiment": None})
        if step is not None:
            (run / "checkpoints").mkdir()
            torch.save({"global_step": step}, run / "checkpoints" / "last.ckpt")
    ddp = root / "2026-01-01" / "10-00-00.000_ddp_aaaaaa"
    assert last_checkpoint(ddp / "checkpoints") == ddp / "checkpoints" / "last.ckpt"
    assert checkpoint_step(ddp / "checkpoints" / "last.ckpt") == 7
    message = no_checkpoint_message(tmp_path / "new" / "checkpoints", root, {"strategy": "ddp", "experiment": None})
    assert message.startswith("ckpt_path=last, but ") and "resume=<its folder>" in message
    assert f"lp-train resume={ddp}    # step 7" in message
    assert "bbbbbb" not in message and "tensor" not in message.split("\n", 1)[1]  # no checkpoint / other strategy
    assert "No run of nlp_gpt" in no_checkpoint_message(tmp_path, root, {"experiment": "nlp_gpt", "strategy": "ddp"})


def test_resume_replays_the_original_overrides_and_the_new_ones_win(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- model=gpt_tiny\n- trainer.max_steps=4\n- hydra.run.dir=x\n- ckpt_path=last\n- resume=old\n")
    given = [f"resume={tmp_path}", "trainer.max_steps=8"]
    assert resume_overrides(tmp_path, given) == ["model=gpt_tiny", *given]
    with pytest.raises(ValueError, match="not a run folder"):
        resume_overrides(tmp_path / "nope", given)


def test_a_resume_that_chooses_a_group_anew_drops_the_old_choices_settings(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- model=gpt_moe\n- strategy=hybrid\n- strategy.expert_parallel_size=2\n- trainer.devices=2\n")
    given = [f"resume={tmp_path}", "strategy=single", "trainer.devices=1"]
    assert resume_overrides(tmp_path, given) == ["model=gpt_moe", *given]


def test_the_furthest_checkpoint_wins_over_the_newest_file(tmp_path):
    import os

    torch.save({"global_step": 14}, tmp_path / "last-stop.ckpt")
    torch.save({"global_step": 12}, tmp_path / "last.ckpt")
    os.utime(tmp_path / "last-stop.ckpt", (1, 1))  # older file, further step
    assert last_checkpoint(tmp_path) == tmp_path / "last-stop.ckpt"


@pytest.mark.parametrize(("max_steps", "accumulate", "interval", "expected"),
                         [(10, 1, 100, 10), (400, 1, 100, None), (6, 1, 3, None), (4, 1, 3, 2), (5, 2, 100, 10),
                          (7, 1, 3, None), (10, 1, 4, 2), (12, 1, 5, 4)])
def test_validation_runs_at_least_once_and_on_the_last_step(max_steps, accumulate, interval, expected):
    cfg = OmegaConf.create({"trainer": {"max_steps": max_steps, "accumulate_grad_batches": accumulate,
                                        "val_check_interval": interval, "check_val_every_n_epoch": 1}})
    note = validation_schedule(cfg)
    if expected is None:
        assert note is None and cfg.trainer.val_check_interval == interval
    else:
        assert cfg.trainer.val_check_interval == expected and cfg.trainer.check_val_every_n_epoch is None
        assert f"every {expected} batches" in note and f"trainer.val_check_interval={interval}" in note


def test_unknown_trainer_keys_get_did_you_mean():
    assert unknown_trainer_key("max_steps") is None
    assert unknown_trainer_key("max_step", "5").startswith(
        "trainer.max_step is not a Trainer argument: did you mean trainer.max_steps=5?"
    )
    with pytest.raises(ConfigError, match="did you mean trainer.accelerator=cpu"):
        check_trainer_overrides(["model=gpt_tiny", "+trainer.acelerator=cpu"])
    check_trainer_overrides(["trainer.devices=2", "trainer=cpu_test", "strategy.trainer=1"])


def test_a_failed_job_gets_a_row_with_its_errors_first_line(tmp_path):
    record_failure(tmp_path / "3_data.path=x", ValueError("data.path=x does not exist: give a file\nmore detail"))
    row = job_row(tmp_path / "3_data.path=x")
    assert row["status"] == "failed: data.path=x does not exist: give a file"
    assert json.loads((tmp_path / "3_data.path=x" / "failure.json").read_text())["type"] == "ValueError"
    assert os.path.basename(row["job"]) == "3_data.path=x"


def test_a_sharded_folder_under_lightnings_own_strategy_is_refused_before_start_with_both_fixes(tmp_path):
    from lightning_parallel.cli.run_start import check_start_readable
    from lightning_parallel.strategies import HybridParallelStrategy

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    with pytest.raises(ConfigError, match="strategy=hybrid strategy.pipeline_parallel_size=1 .*lp-convert"):
        check_start_readable("auto", folder)
    check_start_readable(HybridParallelStrategy(), folder)  # the suite reads it
    torch.save({"global_step": 1}, tmp_path / "one.ckpt")
    check_start_readable("auto", tmp_path / "one.ckpt")  # Lightning reads single files
