"""Issue 7: experiments pin a scaling reference, launcher configs compose, sweeps end in a summary."""

import csv
import json
import math
import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_parallel.cli.sweep_summary import SUMMARY_FILE, SweepSummary, summarise
from lightning_parallel.cli.train import CONFIG_DIR, apply_scaling, layout_of, world_size_of
from tests.integration.forked_cli import forked_or_spawned

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000"]


def _compose(overrides, hydra_config=False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, "paths.output_dir=/tmp/lp-compose-test"],
                       return_hydra_config=hydra_config)


def _effective(overrides):
    cfg = _compose(overrides)
    strategy = cfg.strategy if isinstance(cfg.strategy, str) else instantiate(cfg.strategy)
    return cfg, apply_scaling(cfg, layout_of(strategy, world_size_of(cfg)))


def test_nlp_gpt_rescales_from_its_reference_with_the_sqrt_rule():
    _, at_reference = _effective(["experiment=nlp_gpt"])
    assert (at_reference.global_batch_size, at_reference.lr, at_reference.warmup_steps) == (32, 3e-3, 30)
    cfg, on_eight = _effective(["experiment=nlp_gpt", "trainer.devices=8"])
    assert (on_eight.global_batch_size, on_eight.warmup_steps) == (128, 8)
    assert math.isclose(on_eight.lr, 6e-3)
    # The effective values are what the model and trainer will be built from.
    assert math.isclose(cfg.model.optimizer.lr, 6e-3) and cfg.model.warmup_steps == 8
    assert cfg.scaling.effective.global_batch_size == 128


def test_pipeline_experiment_keeps_the_global_batch_by_accumulating():
    cfg, eff = _effective(["experiment=nlp_gpt_pipeline"])
    assert (eff.data_parallel, eff.accumulate_grad_batches, eff.global_batch_size) == (1, 2, 32)
    assert cfg.trainer.accumulate_grad_batches == 2
    _, on_four = _effective(["experiment=nlp_gpt_pipeline", "trainer.devices=4"])
    assert (on_four.data_parallel, on_four.accumulate_grad_batches, on_four.global_batch_size) == (2, 1, 32)


def test_layouts_experiment_is_a_sweep_over_strategies():
    cfg = _compose(["experiment=nlp_gpt_layouts"], hydra_config=True)
    assert str(cfg.hydra.mode).endswith("MULTIRUN")
    assert cfg.hydra.sweeper.params.strategy.split(",") == ["ddp", "deepspeed_zero2", "pipeline", "tensor"]
    assert cfg.scaling.rule == "fixed_global_batch"


def test_fixed_global_batch_error_names_the_fix_before_anything_starts():
    with pytest.raises(ValueError, match="data.batch_size"):
        _effective(["scaling=fixed_global_batch", "data.batch_size=3"])


@pytest.mark.parametrize(("launcher", "gpus"), [("slurm", 1), ("slurm_cpu", None)])
def test_slurm_launcher_takes_nodes_and_tasks_from_the_trainer(launcher, gpus):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[cluster]'")
    cfg = _compose([f"hydra/launcher={launcher}", "trainer.num_nodes=2", "trainer.devices=4"], hydra_config=True)
    launcher_cfg = cfg.hydra.launcher
    assert launcher_cfg._target_.endswith("SlurmLauncher")
    assert (launcher_cfg.nodes, launcher_cfg.tasks_per_node, launcher_cfg.gpus_per_task) == (2, 4, gpus)


def test_sweep_summary_collects_job_folders_and_marks_missing_ones(tmp_path, capsys):
    def job(name, strategy, layout, val_loss):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        effective = {"rule": "fixed_global_batch", "micro_batch_size": 4,
                     "accumulate_grad_batches": 4 if "dp2" in layout else 8,
                     "global_batch_size": 32, "lr": 3e-3, "warmup_steps": 30, "data_parallel": 2}
        metrics = {"val_loss": val_loss, "train_loss": 5.0, "throughput/samples_per_sec": 500.0}
        data = {"strategy": strategy, "devices": 2, "num_nodes": 1, "world_size": 2, "layout": layout,
                "effective": effective, "metrics": metrics, "overrides": f"strategy={strategy}"}
        (tmp_path / name / "metrics.json").write_text(json.dumps(data))

    job("0_strategy=ddp", "ddp", "dp2 x pp1 x tp1", 2.5)
    job("10_strategy=tensor", "tensor", "dp1 x pp1 x tp2", 2.6)
    (tmp_path / "1_strategy=pipeline" / ".hydra").mkdir(parents=True)  # a job that died
    callback = SweepSummary()
    callback.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    callback.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": "/elsewhere"}}}))
    with open(tmp_path / SUMMARY_FILE) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["job"].split("_")[0] for r in rows] == ["0", "1", "10"]  # job order, not text order
    assert rows[0]["strategy"] == "ddp" and float(rows[0]["val_loss"]) == 2.5 and rows[0]["global_batch_size"] == "32"
    assert rows[1]["status"].startswith("missing metrics.json")
    out = capsys.readouterr().out
    assert "sweep summary (3 jobs)" in out and "32 = 4 x 8 x dp1" in out and "missing" in out
    assert summarise(tmp_path / "nothing") == []


def _train(args, cwd, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    result = forked_or_spawned("lightning_parallel.cli.train", [*args], cwd, env, timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


@pytest.mark.extended
def test_sweep_over_strategies_finishes_with_its_summary(tmp_path):
    # The command: every strategy on 2 devices, each job in its own folder, then the table.
    out = _train(["-m", *TINY, "strategy=ddp,deepspeed_zero2,pipeline,tensor", "trainer.devices=2",
                  "scaling=fixed_global_batch", "logger=none", "callbacks=none", f"hydra.sweep.dir={tmp_path}/sweep"],
                 tmp_path)
    with open(tmp_path / "sweep" / SUMMARY_FILE) as handle:
        rows = list(csv.DictReader(handle))
    assert [r["strategy"] for r in rows] == ["ddp", "deepspeed_zero2", "pipeline", "tensor"], out[-3000:]
    assert [r["layout"] for r in rows] == ["dp2 x pp1 x tp1", "dp2 x pp1 x tp1", "dp1 x pp2 x tp1", "dp1 x pp1 x tp2"]
    assert {r["status"] for r in rows} == {"ok"}
    # fixed_global_batch: every layout at the reference global batch, accumulating where dp is 1.
    assert {r["global_batch_size"] for r in rows} == {"32"}
    assert [r["accumulate_grad_batches"] for r in rows] == ["4", "4", "8", "8"]
    losses = [float(r["val_loss"]) for r in rows]
    assert all(math.isfinite(v) and v < math.log(256) for v in losses)
    assert max(losses) - min(losses) < 0.05  # same optimisation; only the sample order differs
    assert "sweep summary (4 jobs)" in out


@pytest.mark.extended
def test_optuna_search_runs_trials_and_reports_the_best(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[sweep]'")
    # data.batch_size is searched: a command-line value would pin it.
    tiny = [o for o in TINY if not o.startswith("data.batch_size")]
    out = _train(["-m", "hparams_search=gpt_optuna", *tiny, "trainer.devices=1", "hydra.sweeper.n_trials=2",
                  "logger=none", "callbacks=none", f"hydra.sweep.dir={tmp_path}/sweep"], tmp_path)
    best = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert best.name == "optuna" and math.isfinite(best.best_value)
    assert set(best.best_params) == {"model.optimizer.lr", "data.batch_size"}
    with open(tmp_path / "sweep" / SUMMARY_FILE) as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}, out[-3000:]
    assert min(float(r["val_loss"]) for r in rows) == pytest.approx(best.best_value)
