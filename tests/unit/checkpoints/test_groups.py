"""Naming the positions of a Lightning file's optimizer state: inferred for every recipe's param groups, refused
when ambiguous with the fix (``lp-convert --module``), which then converts it exactly."""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from examples.nlp.model import GPT
from examples.recsys.model import DLRM
from examples.vision.model import ViT
from lightning_parallel.checkpoints import load_sharded_checkpoint
from lightning_parallel.checkpoints.lightning.groups import PositionsUnknown, infer_group_names, module_group_names
from lightning_parallel.checkpoints.lightning.reader import optimizer_group_names, trainable_weights
from lightning_parallel.cli.convert import main

from .conftest import LIGHTNING_STATE, write_zero0_folder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _hf(config: str, **overrides):
    pytest.importorskip("transformers")
    from examples.nlp.hf_causal_lm import HFCausalLM

    return HFCausalLM(config, overrides)


RECIPES = {
    "gpt": partial(GPT, vocab_size=64, seq_len=16, d_model=16, n_layer=2, n_head=2),
    "gpt_moe": partial(GPT, vocab_size=64, seq_len=16, d_model=16, n_layer=2, n_head=2,
                       moe={"every": 2, "num_experts": 4, "top_k": 2}),
    "vit": partial(ViT, image_size=8, patch_size=2, in_channels=1, num_classes=10, d_model=16, n_layer=2, n_head=2),
    "dlrm": DLRM,
    "hf_llama": partial(_hf, "llama"),
    "hf_qwen2_tied": partial(_hf, "qwen2", tie_word_embeddings=True),
}


def _stepped_optimizer(module: pl.LightningModule) -> tuple[torch.optim.Optimizer, list[list[list[str]]]]:
    """The module's optimizer after one step, and the true names of each of its param groups."""
    if callable(getattr(module, "configure_model", None)):
        module.configure_model()
    answer = module.configure_optimizers()
    optimizer = answer["optimizer"] if isinstance(answer, dict) else answer
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    names = {id(p): n for n, p in module.named_parameters()}
    return optimizer, [[[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]]


def _stepped(module: pl.LightningModule) -> tuple[dict, list[list[list[str]]]]:
    """A Lightning file's dict after one optimizer step, and the true names of each param group."""
    optimizer, truth = _stepped_optimizer(module)
    return {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}, truth


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipes_weight_decay_groups_are_named_from_the_file_alone(recipe):
    checkpoint, truth = _stepped(RECIPES[recipe]())
    assert len(truth[0]) == 2  # decaying matrices, and the rest
    assert optimizer_group_names(checkpoint) == truth


class Twins(pl.LightningModule):
    """Two parameters of one shape, side by side, each in its own param group: positions cannot tell them apart."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.a = nn.Parameter(torch.randn(width))
        self.b = nn.Parameter(torch.randn(width))
        self.register_buffer("scale", torch.ones(3))  # a float buffer of its own shape: skipped

    def configure_optimizers(self):
        return torch.optim.AdamW([{"params": [self.b], "weight_decay": 0.5}, {"params": [self.a]}], lr=0.1)


def _twins_file(tmp_path):
    module = Twins()
    optimizer = module.configure_optimizers()
    module.a.grad, module.b.grad = torch.ones(4), -torch.ones(4)
    optimizer.step()
    checkpoint = {**LIGHTNING_STATE, "state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()],
                  "hyper_parameters": {"width": 4}, "hparams_name": "kwargs"}
    torch.save(checkpoint, tmp_path / "twins.ckpt")
    return tmp_path / "twins.ckpt", module, optimizer


def test_ambiguous_positions_are_refused_naming_the_option_that_resolves_them(tmp_path, capsys):
    path, module, optimizer = _twins_file(tmp_path)
    with pytest.raises(PositionsUnknown, match="more than one assignment fits.*--module"):
        infer_group_names(optimizer.state_dict(), trainable_weights(module.state_dict()))
    assert main([str(path), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lp-convert --module package.module.Class" in err and "--no-optimizer" in err
    # What the error offers works: weights-only outputs need no names, --no-optimizer leaves the state out ...
    assert main([str(path), str(tmp_path / "w.pt")]) == 0
    assert main([str(path), str(tmp_path / "w.ckpt"), "--no-optimizer"]) == 0
    # ... and --module names the groups from the module's own configure_optimizers, exactly.
    assert main([str(path), str(tmp_path / "out.ckpt"), "--module", f"{__name__}.Twins"]) == 0
    fresh = Twins(width=4)
    fresh_optimizer = fresh.configure_optimizers()
    load_sharded_checkpoint(tmp_path / "out.ckpt", fresh, [fresh_optimizer])
    for name in ("a", "b"):
        live, loaded = optimizer.state[getattr(module, name)], fresh_optimizer.state[getattr(fresh, name)]
        assert torch.equal(live["exp_avg"], loaded["exp_avg"]), name
    assert [g["weight_decay"] for g in fresh_optimizer.param_groups] == [0.5, 0.01]


def test_module_group_names_builds_the_module_on_meta_from_the_hyper_parameters():
    assert module_group_names(f"{__name__}.Twins", {"width": 4}, "kwargs") == [[["b"], ["a"]]]
    with pytest.raises(ValueError, match="names no importable class"):
        module_group_names(f"{__name__}.Missing", {})
    with pytest.raises(ValueError, match="calling configure_optimizers failed.*TypeError"):
        module_group_names(f"{__name__}.Twins", {"depth": 2})


def test_positions_without_state_cannot_tell_groups_apart_but_one_group_still_can():
    module = GPT(vocab_size=64, seq_len=16, d_model=16, n_layer=1, n_head=2)
    module.configure_model()
    fresh = module.configure_optimizers()["optimizer"]  # saved before its first step: no state, no shapes
    with pytest.raises(PositionsUnknown, match="more than one assignment"):
        infer_group_names(fresh.state_dict(), trainable_weights(module.state_dict()))
    single = torch.optim.AdamW(module.parameters())
    names = [name for name, _ in module.named_parameters()]
    assert infer_group_names(single.state_dict(), trainable_weights(module.state_dict())) == [names]


def _zero0_with_hyper_parameters(root, module, optimizer, hyper_parameters):
    """A ZeRO stage 0 folder (conftest's layout) whose Lightning state holds the module's hyper-parameters."""
    folder = write_zero0_folder(root, module, optimizer)
    states = folder / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(states, weights_only=False), "hyper_parameters": hyper_parameters,
                "hparams_name": "kwargs"}, states)
    return folder


def test_zero0_param_groups_are_named_like_a_lightning_files(tmp_path, capsys):
    """ZeRO stage 0 keeps positions too: weight-decay groups are inferred, ambiguous ones take --module."""
    gpt = RECIPES["gpt"]()
    optimizer, truth = _stepped_optimizer(gpt)
    folder = _zero0_with_hyper_parameters(tmp_path / "gpt.ckpt", gpt, optimizer, {})
    assert main([str(folder), str(tmp_path / "gpt.lightning"), "--to", "lightning"]) == 0
    converted = torch.load(tmp_path / "gpt.lightning", weights_only=True)
    assert converted["lightning_parallel"]["param_groups"] == truth
    assert converted["optimizer_states"][0]["param_groups"] == optimizer.state_dict()["param_groups"]
    _, twins, twins_optimizer = _twins_file(tmp_path)
    folder = _zero0_with_hyper_parameters(tmp_path / "twins_zero0", twins, twins_optimizer, {"width": 4})
    assert main([str(folder), str(tmp_path / "twins.dcp")]) == 2
    assert "--module package.module.Class" in capsys.readouterr().err
    assert main([str(folder), str(tmp_path / "twins.dcp"), "--no-optimizer"]) == 0
    assert "optimizer state left out" in capsys.readouterr().out
    assert main([str(folder), str(tmp_path / "twins.lightning"), "--to", "lightning", "--module",
                 f"{__name__}.Twins"]) == 0
    (state,) = torch.load(tmp_path / "twins.lightning", weights_only=True)["optimizer_states"]
    expected = twins_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert all(torch.equal(state["state"][i]["exp_avg"], expected["state"][i]["exp_avg"]) for i in (0, 1))
