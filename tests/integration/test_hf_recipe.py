"""The Hugging Face recipe through Hydra: its configs compose into a no-glue module, padded data and
the layout they promise, and ``lp-train experiment=hf_tensor`` trains end to end on 2 processes."""

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from lightning_parallel.cli.train import CONFIG_DIR, layout_of, world_size_of
from lightning_parallel.testing import run_processes
from tests.integration.forked_cli import forked_or_spawned
from tests.integration.recipe_runs import fit_pretrained_cases, full_documents

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

ROOT = Path(__file__).resolve().parents[2]

# experiment -> (data, pipeline, tensor) sizes at its default device count
EXPERIMENTS = {"hf_tensor": (1, 1, 2), "hf_pipeline": (1, 2, 1), "hf_hybrid": (1, 2, 2)}
PROTOCOL_METHODS = ("pipeline_layers", "pipeline_loss", "pipeline_loss_terms", "pipeline_split_batch",
                    "tensor_parallel_plan")
TINY_RUN = ["trainer.max_steps=4", "trainer.val_check_interval=2", "data.max_val_batches=2", "data.seq_len=32",
            "data.batch_size=4", "data.max_bytes=100000", "trainer.enable_progress_bar=false", "logger=none"]


def _compose(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, "paths.output_dir=/tmp/lp-hf-recipe-test"])


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_composes_a_glue_free_module_padded_data_and_its_layout(experiment):
    cfg = _compose([f"experiment={experiment}", "model.config=qwen2"])
    strategy = instantiate(cfg.strategy)
    layout = layout_of(strategy, world_size_of(cfg))
    assert (layout.data_parallel, layout.pipeline_parallel, layout.tensor_parallel) == EXPERIMENTS[experiment]
    model, data = instantiate(cfg.model).build(), instantiate(cfg.data)
    assert not [name for name in PROTOCOL_METHODS if hasattr(model, name)]
    assert model.model.config.tie_word_embeddings and model.model.config.vocab_size == data.hparams.vocab_size == 128
    data.setup()
    batch = next(iter(data.val_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert (batch["labels"] == -100).any() and int(batch["input_ids"].max()) < 128
    assert batch["input_ids"].shape[0] % cfg.strategy.get("microbatches", 1) == 0


def test_hybrid_experiment_on_eight_devices_adds_data_parallelism():
    cfg = _compose(["experiment=hf_hybrid", "trainer.devices=8"])
    layout = layout_of(instantiate(cfg.strategy), world_size_of(cfg))
    assert (layout.data_parallel, layout.pipeline_parallel, layout.tensor_parallel) == (2, 2, 2)


@pytest.mark.slow
def test_lp_train_hf_tensor_on_two_processes_learns(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    # No warm-up: the experiment's 30 warm-up steps would leave 4 steps at a near-zero learning rate.
    args = ["experiment=hf_tensor", "trainer.devices=2", *TINY_RUN, "model.warmup_steps=0",
            f"hydra.run.dir={tmp_path}/run"]
    result = forked_or_spawned("lightning_parallel.cli.train", [*args], tmp_path, env, 600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    print(f"hf_tensor val_loss after 4 steps: {metrics['metrics']['val_loss']:.4f} (uniform: ln 128 = 4.852)")
    assert metrics["metrics"]["val_loss"] < 4.7  # random init predicts about uniformly: ln(128) = 4.85


PRETRAINED_VOCAB = 160  # not the recipe's 128: the folder's vocabulary must win without any override
PRETRAINED_CASES = {  # on 2 processes: the suite's layouts (meta build, each rank reads its slices) and Lightning's DDP
    "pp2": dict(strategy="pipeline"), "tp2": dict(strategy="tensor"), "ddp": dict(strategy="ddp", data_parallel=2),
    "zero3": dict(strategy="deepspeed_zero3", data_parallel=2),
}


def _first_loss(model, samples: int = 8) -> float:
    import torch

    documents = full_documents()
    batch = torch.utils.data.default_collate([documents[i] for i in range(samples)])
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.slow
def test_pretrained_folder_is_the_start_of_every_layout(tmp_path):
    """``model.pretrained=DIR`` alone: every layout's first loss is ``from_pretrained(DIR)``'s on that batch."""
    import torch
    import transformers

    from examples.nlp.hf_causal_lm import HFCausalLM, build_config

    folder = tmp_path / "pretrained"
    torch.manual_seed(123)  # weights no run of the recipe would draw
    transformers.AutoModelForCausalLM.from_config(build_config("qwen2", vocab_size=PRETRAINED_VOCAB)).save_pretrained(
        folder)
    expected = _first_loss(transformers.AutoModelForCausalLM.from_pretrained(folder).float())
    torch.manual_seed(0)
    random_start = _first_loss(HFCausalLM(config=str(folder), vocab_size=None).build().model)
    assert abs(random_start - expected) > 1e-3  # the check below can tell the folder's weights from a random start
    results = run_processes(fit_pretrained_cases, 2, str(folder), PRETRAINED_CASES, timeout=900)
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            assert "error" not in result, f"{name} rank {rank}: {result['error']}"
            assert result["vocab_size"] == PRETRAINED_VOCAB, (name, result)
            first = result["losses"][0]
            print(f"{name} rank {rank}: first loss {first:.6f}, from_pretrained {expected:.6f}")
            assert abs(first - expected) < 1e-5, (name, rank, first, expected)


class FirstBatchLoss(pl.Callback):
    """Test-only: rank 0 saves the first training batch and its global loss (what ``lp-train`` logs at step 0)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        if trainer.global_step != 1 or batch_idx != 0:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        value = float(trainer.strategy.reduce(loss.detach().double(), reduce_op="mean"))
        if trainer.global_rank == 0:
            torch.save({"batch": {k: v.detach().cpu() for k, v in batch.items()}, "loss": value}, self.path)


@pytest.mark.slow
def test_lp_train_hf_hybrid_fine_tunes_a_pretrained_folder_with_one_override(tmp_path):
    """``lp-train experiment=hf_hybrid model.pretrained=DIR``: config, vocabulary (160, not the recipe's 128) and
    weights from the folder on pp2 x tp2 (4 processes), the first logged loss is ``from_pretrained(DIR)``'s on that
    batch, and ``lp-convert --to hf`` writes a folder ``from_pretrained`` loads."""
    import torch
    import transformers

    from examples.nlp.hf_causal_lm import build_config

    folder = tmp_path / "pretrained"
    torch.manual_seed(123)
    transformers.AutoModelForCausalLM.from_config(build_config("qwen2", vocab_size=PRETRAINED_VOCAB)).save_pretrained(
        folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}
    record = tmp_path / "first.pt"
    args = ["experiment=hf_hybrid", f"model.pretrained={folder}", *TINY_RUN, f"hydra.run.dir={tmp_path}/run",
            f"+callbacks.first._target_={__name__}.FirstBatchLoss", f"+callbacks.first.path={record}"]
    result = forked_or_spawned("lightning_parallel.cli.train", [*args], ROOT, env, 900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    first = torch.load(record, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    with torch.no_grad():
        expected = float(model(**first["batch"]).loss)
    print(f"hf_hybrid first loss {first['loss']:.6f}, from_pretrained on that batch {expected:.6f}")
    assert abs(first["loss"] - expected) < 1e-5
    checkpoint = next((tmp_path / "run" / "checkpoints").glob("last*"))
    exported = tmp_path / "exported"
    convert = forked_or_spawned("lightning_parallel.cli.convert", [checkpoint, exported, "--to", "hf"], ROOT, env, 600)
    assert convert.returncode == 0, convert.stdout[-2000:] + convert.stderr[-3000:]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert loaded.config.vocab_size == PRETRAINED_VOCAB and type(loaded).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert torch.isfinite(loaded(**first["batch"]).loss)
