"""Foreign checkpoints on one process: which writer, read into the suite's keys, loaded, or refused with the fix."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoints import optimizer_state_dict, save_on_one_process
from lightning_parallel.checkpoints.detect import (
    identify_writer,
    read_lightning_checkpoint,
    unreadable_checkpoint_error,
)
from lightning_parallel.checkpoints.lightning.reader import flatten_optimizer_state, name_positions
from lightning_parallel.checkpoints.resume import resume_from
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused
from lightning_parallel.testing.models import ResidualMLP

from .conftest import LIGHTNING_STATE, WIDTH, trained_module, write_zero0_folder

pytestmark = pytest.mark.filterwarnings("ignore:.*(single process|torch.distributed is disabled).*")


def _fresh(optimizer: str = "adamw") -> tuple[ResidualMLP, torch.optim.Optimizer]:
    module = ResidualMLP(width=WIDTH, depth=2, optimizer=optimizer, seed=7)
    return module, module.configure_optimizers()


def _lightning_file(path: Path, module, optim) -> Path:
    """What trainer.save_checkpoint writes under Lightning's single-device or DDP strategy."""
    torch.save({**LIGHTNING_STATE, "pytorch-lightning_version": "2.6.6", "state_dict": module.state_dict(),
                "optimizer_states": [optim.state_dict()]}, path)
    return path


def _lightning_dcp(path: Path, module, optim, model_key: str = "state_dict") -> Path:
    """What Lightning's ModelParallelStrategy (or FSDPStrategy, model_key="model") writes: nested param groups."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {model_key: module.state_dict(), "optimizer_0": get_optimizer_state_dict(module, optim)}
    return save_on_one_process(path, state, dict(LIGHTNING_STATE))


@pytest.fixture
def trained(tmp_path):
    module, optim = trained_module()
    return tmp_path, module, optim


def test_each_writer_is_identified_without_unpickling(trained, dcp_folder):
    root, module, optim = trained
    assert identify_writer(dcp_folder[0]) == "suite-dcp"
    assert identify_writer(_lightning_file(root / "single.ckpt", module, optim)) == "lightning-single-file"
    assert identify_writer(_lightning_dcp(root / "mp.ckpt", module, optim)) == "lightning-dcp"
    assert identify_writer(_lightning_dcp(root / "fsdp.ckpt", module, optim, "model")) == "lightning-dcp"
    assert identify_writer(write_zero0_folder(root / "zero0.ckpt", module, optim)) == "deepspeed"
    torch.save(module.state_dict(), root / "plain.pt")
    assert identify_writer(root / "plain.pt") == "unknown"
    assert identify_writer(root / "nowhere.ckpt") == "unknown"


def test_unreadable_checkpoints_say_what_they_look_like_and_the_fix(trained):
    root, module, optim = trained
    data = _lightning_file(root / "single.ckpt", module, optim).read_bytes()
    (root / "cut.ckpt").write_bytes(data[: len(data) // 2])
    torch.save(module.state_dict(), root / "plain.pt")
    (root / "empty").mkdir()
    assert "truncated or damaged" in str(unreadable_checkpoint_error(root / "cut.ckpt"))
    assert "module.load_state_dict" in str(unreadable_checkpoint_error(root / "plain.pt"))
    assert "trainer.save_checkpoint wrote" in str(unreadable_checkpoint_error(root / "empty"))
    assert "does not exist" in str(unreadable_checkpoint_error(root / "nowhere"))
    with pytest.raises(ValueError, match="truncated or damaged"):
        resume_from(root / "cut.ckpt", *_fresh()[:1], [])


@pytest.mark.parametrize("writer", ["single", "mp", "fsdp"])
def test_lightning_checkpoints_read_into_the_suite_keys(trained, writer):
    root, module, optim = trained
    path = (_lightning_file(root / "c.ckpt", module, optim) if writer == "single"
            else _lightning_dcp(root / "c.ckpt", module, optim, "model" if writer == "fsdp" else "state_dict"))
    checkpoint = read_lightning_checkpoint(path)
    expected = optimizer_state_dict(module, optim)
    (flat,) = checkpoint["optimizer_states"]
    assert set(flat) == set(expected)
    for key, value in expected.items():
        assert torch.equal(flat[key], value) if torch.is_tensor(value) else flat[key] == value, key
    for key, value in module.state_dict().items():
        assert torch.equal(checkpoint["state_dict"][key], value)
    assert checkpoint["global_step"] == LIGHTNING_STATE["global_step"] and "loops" in checkpoint


@pytest.mark.parametrize("writer", ["single", "mp", "zero0"])
def test_resume_from_loads_weights_and_optimizer_state_exactly(trained, writer):
    root, module, optim = trained
    path = {"single": lambda: _lightning_file(root / "c.ckpt", module, optim),
            "mp": lambda: _lightning_dcp(root / "c.ckpt", module, optim),
            "zero0": lambda: write_zero0_folder(root / "c.ckpt", module, optim)}[writer]()
    fresh, fresh_optim = _fresh()
    meta = resume_from(path, fresh, [fresh_optim])
    assert meta["global_step"] == LIGHTNING_STATE["global_step"] and "state_dict" not in meta
    for (name, a), b in zip(module.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for key, value in optim.state[a].items():
            assert torch.equal(torch.as_tensor(fresh_optim.state[b][key]), torch.as_tensor(value)), (name, key)
    assert not list(root.parent.glob("lightning_parallel-deepspeed-*"))


def test_load_optimizer_state_false_loads_the_weights_and_warns_what_was_dropped(trained):
    root, module, optim = trained
    fresh, fresh_optim = _fresh()
    with pytest.warns(UserWarning, match="optimizer state .* was dropped"):
        resume_from(_lightning_file(root / "c.ckpt", module, optim), fresh, [fresh_optim], load_optimizer_state=False)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), fresh.parameters()))
    assert not fresh_optim.state


def test_a_different_optimizer_or_param_groups_is_refused_with_the_fix(trained):
    root, module, optim = trained
    path = _lightning_file(root / "c.ckpt", module, optim)
    fresh = ResidualMLP(width=WIDTH, depth=2, seed=7)
    with pytest.raises(ValueError, match="momentum_buffer.*load_optimizer_state=False"):
        resume_from(path, fresh, [torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)])
    params = list(fresh.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2], "lr": 0.5}, {"params": params[2:]}], lr=1e-2)
    with pytest.raises(ValueError, match="Param-group mismatch.*load_optimizer_state=False"):
        resume_from(path, fresh, [two_groups])


def test_state_that_is_not_per_element_is_refused(trained):
    _, module, optim = trained
    saved = optim.state_dict()
    saved["state"][0]["exp_avg"] = torch.zeros(3)  # a factored moment, say
    with pytest.raises(ValueError, match="not laid out like the parameter.*load_optimizer_state=False"):
        name_positions(saved, module.state_dict())


def test_positions_need_the_module_when_buffers_make_the_count_ambiguous(trained):
    _, module, optim = trained
    first = next(iter(module.state_dict().values()))
    named = name_positions(optim.state_dict(), {**module.state_dict(), "extra_buffer": torch.zeros(2)})
    assert list(named["state"]) == [name for name, _ in module.named_parameters()]  # a buffer of its own shape
    weights = {"extra_buffer": torch.zeros_like(first), **module.state_dict()}  # one shaped like a parameter
    with pytest.raises(ValueError, match="more than one assignment fits.*--module"):
        name_positions(optim.state_dict(), weights)
    names = [[n for n, _ in module.named_parameters()]]
    assert set(name_positions(optim.state_dict(), weights, names)["state"]) == set(names[0])


def test_several_param_groups_need_their_names():
    module, _ = trained_module()
    decay = [p for n, p in module.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in module.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    # Norm weights and biases share one shape across the groups: more than one naming fits.
    with pytest.raises(ValueError, match="2 param group.*more than one assignment.*--module"):
        name_positions(optim.state_dict(), module.state_dict())
    names = [[n for n, _ in module.named_parameters() if n.endswith("weight")],
             [n for n, _ in module.named_parameters() if not n.endswith("weight")]]
    named = name_positions(optim.state_dict(), module.state_dict(), names)
    assert named["param_groups"][1]["params"] == names[1] and named["param_groups"][1]["weight_decay"] == 0.0


def test_flattening_matches_torchs_own_optimizer_state_dict(trained):
    _, module, optim = trained
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    nested = get_optimizer_state_dict(module, optim)
    assert flatten_optimizer_state(nested).keys() == optimizer_state_dict(module, optim).keys()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_parallel_pwned_foreign_unit",))


def test_a_tampered_single_file_is_refused_without_running_it(trained):
    root, module, optim = trained
    torch.save({**LIGHTNING_STATE, "pytorch-lightning_version": "2.6.6", "state_dict": module.state_dict(),
                "optimizer_states": [optim.state_dict()], "callbacks": _Payload()}, root / "bad.ckpt")
    assert identify_writer(root / "bad.ckpt") == "lightning-single-file"
    fresh, fresh_optim = _fresh()
    with pytest.raises(CheckpointRefused, match="Refusing.*weights_only=False"):
        resume_from(root / "bad.ckpt", fresh, [fresh_optim])
    assert not Path("/tmp/lightning_parallel_pwned_foreign_unit").exists()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(root / "bad.ckpt", weights_only=True)


def test_the_strategy_validates_load_optimizer_state():
    from lightning_parallel.strategies import HybridParallelStrategy

    with pytest.raises(ValueError, match="load_optimizer_state must be True"):
        HybridParallelStrategy(load_optimizer_state="no")
    assert HybridParallelStrategy(load_optimizer_state=False).load_optimizer_state is False


def test_the_hugging_face_entry_names_the_model_its_prefix_and_config():
    transformers = pytest.importorskip("transformers")
    from lightning_parallel.adapters import adapt

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    holder = torch.nn.Module()
    holder.model = transformers.AutoModelForCausalLM.from_config(config)
    entry = adapt(holder).checkpoint_metadata()["hugging_face"]
    assert entry["prefix"] == "model" and entry["class"] == "LlamaForCausalLM"
    assert entry["config"]["hidden_size"] == 8
    assert adapt(ResidualMLP()).checkpoint_metadata() == {}


def test_the_deepspeed_strategy_refuses_other_writers_with_the_fix(trained):
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    root, module, optim = trained
    strategy = DeepSpeedDataParallelStrategy(zero_stage=2)
    with pytest.raises(ValueError, match="single-file Lightning checkpoint.*HybridParallelStrategy"):
        strategy.load_checkpoint(_lightning_file(root / "c.ckpt", module, optim))
    torch.save(module.state_dict(), root / "plain.pt")
    with pytest.raises(ValueError, match="without Lightning's entries"):
        strategy.load_checkpoint(root / "plain.pt")


def test_a_single_file_with_interleaved_param_groups_resumes_exactly(tmp_path):
    """Weight decay on matrices only, as the GPT recipe groups them: positions follow the groups, not the module."""
    import torch.nn.functional as F

    def grouped(module):
        decay = [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() == 2]
        rest = [p for n, p in module.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
        return torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)

    module = ResidualMLP(width=WIDTH, depth=2, seed=0)
    optim = grouped(module)
    for _ in range(2):
        optim.zero_grad()
        F.mse_loss(module(torch.randn(4, WIDTH)), torch.randn(4, WIDTH)).backward()
        optim.step()
    fresh = ResidualMLP(width=WIDTH, depth=2, seed=7)
    fresh_optim = grouped(fresh)
    resume_from(_lightning_file(tmp_path / "c.ckpt", module, optim), fresh, [fresh_optim])
    for (name, a), b in zip(module.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b) and torch.equal(optim.state[a]["exp_avg_sq"], fresh_optim.state[b]["exp_avg_sq"]), name
    assert [g["weight_decay"] for g in fresh_optim.param_groups] == [0.1, 0.0]
