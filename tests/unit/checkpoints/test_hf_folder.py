"""Hugging Face folders in and out on one process: ``lp-convert --to hf`` and :func:`load_hf_weights` (issue 15)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_parallel.adapters import adapt
from lightning_parallel.callbacks import HuggingFaceWeights
from lightning_parallel.checkpoints import save_on_one_process
from lightning_parallel.checkpoints.hf.load import load_hf_weights
from lightning_parallel.cli.convert import main
from lightning_parallel.parallel.pipeline.stages import RemovedLayer

from .conftest import LIGHTNING_STATE

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROBE = torch.arange(24).reshape(2, 12) % 60 + 3


class Holder(nn.Module):
    """What a LightningModule holding a Hugging Face model looks like to the state dict: ``model.`` prefix."""

    def __init__(self, tied: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        self.model = transformers.LlamaForCausalLM(config)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=PROBE).logits


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_suite_folder_exports_to_a_folder_from_pretrained_loads(tmp_path, capsys, tied):
    holder = Holder(tied)
    meta = dict(LIGHTNING_STATE, **adapt(holder).checkpoint_metadata())
    save_on_one_process(tmp_path / "run.ckpt", {"state_dict": holder.state_dict()}, meta)
    assert main([str(tmp_path / "run.ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(_logits(loaded), _logits(holder.model), rtol=0, atol=0)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert keys == set(holder.model.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied


def test_without_the_recorded_model_hf_config_names_it_and_the_prefix_is_found(tmp_path, capsys):
    holder = Holder(tied=True)
    holder.model.config.save_pretrained(tmp_path / "config")
    save_on_one_process(tmp_path / "run.ckpt", {"state_dict": holder.state_dict()}, dict(LIGHTNING_STATE))
    assert main([str(tmp_path / "run.ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "pass --hf-config" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    assert main([str(tmp_path / "run.ckpt"), str(tmp_path / "hf"), "--to", "hf", "--hf-config",
                 str(tmp_path / "config" / "config.json")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(_logits(loaded), _logits(holder.model), rtol=0, atol=0)


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["one-file", "sharded"])
def test_load_hf_weights_fills_every_parameter_from_a_folder(tmp_path, shard):
    source = Holder(tied=True, seed=0)
    source.model.save_pretrained(tmp_path / "hf", **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shard)
    target = Holder(tied=True, seed=1)
    report = load_hf_weights(target, tmp_path / "hf", "model")
    assert report["tensors"] == len(target.state_dict())
    for name, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], value, rtol=0, atol=0, msg=name)
    assert target.model.lm_head.weight is target.model.model.embed_tokens.weight


def test_removed_pipeline_layers_are_skipped_and_wrong_folders_are_named(tmp_path):
    Holder(tied=False).model.save_pretrained(tmp_path / "hf")
    stage = Holder(tied=False, seed=1)
    stage.model.model.layers[1] = RemovedLayer("model.model.layers.1", 1)
    stage.model.lm_head = RemovedLayer("model.lm_head", 1)
    report = load_hf_weights(stage, tmp_path / "hf", "model.")
    assert report["tensors"] == len(stage.state_dict())
    with pytest.raises(ValueError, match=r"missing 1 \(model.norm.extra\), unexpected 0"):
        stage.model.model.norm.register_buffer("extra", torch.zeros(1))
        load_hf_weights(stage, tmp_path / "hf", "model.")
    with pytest.raises(ValueError, match="holds no model.safetensors"):
        load_hf_weights(stage, tmp_path, "model.")
    index = {"weight_map": {"stray.weight": "model.safetensors"}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"places stray.weight in model.safetensors, which does not hold it"):
        load_hf_weights(Holder(tied=False), tmp_path / "hf", "model.")


def test_the_callback_leaves_a_resumed_checkpoint_alone(tmp_path):
    Holder(tied=True, seed=0).model.save_pretrained(tmp_path / "hf")
    module = Holder(tied=True, seed=1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    HuggingFaceWeights(tmp_path / "hf").on_fit_start(SimpleNamespace(ckpt_path="last.ckpt"), module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    callback = HuggingFaceWeights(tmp_path / "hf")
    callback.on_fit_start(SimpleNamespace(ckpt_path=None), module)
    assert callback.report["tensors"] == len(before) and not torch.equal(before["model.lm_head.weight"],
                                                                         module.model.lm_head.weight)
