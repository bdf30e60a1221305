"""DeepSpeed -> DCP on a ZeRO-0 folder; the flattened optimizer keys are torch's own."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import checkpoints
from lightning_parallel.checkpoints.deepspeed.convert import _flattened_optimizer_state
from lightning_parallel.testing.models import ResidualMLP

from .conftest import STEPS, WIDTH, trained_module, write_zero0_folder

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_stand_in_optimizer_state_has_the_keys_and_values_torch_saves(optimizer):
    module, optim = trained_module(optimizer)
    expected = checkpoints.optimizer_state_dict(module, optim)
    by_name = dict(module.named_parameters())
    gathered = {"state": {name: dict(optim.state[param]) for name, param in by_name.items()},
                "param_groups": [{**g, "params": list(by_name)} for g in optim.state_dict()["param_groups"]]}
    flat = _flattened_optimizer_state(dict(module.state_dict()), gathered)
    assert flat.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(flat[key], value, rtol=0, atol=0)
        else:
            assert flat[key] == value, key


def test_a_zero0_folder_converts_to_a_folder_the_suite_loads_exactly(zero0_folder, tmp_path):
    source, module, optim = zero0_folder
    assert list(checkpoints.consolidate_state_dict(source)) == list(module.state_dict())
    out = checkpoints.convert_to_dcp(source, tmp_path / "converted.ckpt")
    fresh = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=1)
    fresh_optim = fresh.configure_optimizers()
    meta = checkpoints.load_sharded_checkpoint(out, fresh, [fresh_optim])
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, module.state_dict()[name], rtol=0, atol=0)
    by_name = dict(module.named_parameters())
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(fresh_optim.state[param]["exp_avg"], optim.state[by_name[name]]["exp_avg"],
                                   rtol=0, atol=0)
    assert meta["global_step"] == STEPS and meta["lightning_parallel"]["source"] == "deepspeed 0.19.8 ZeRO-0"
    assert "module" not in meta and "ds_config" not in meta


def test_without_the_optimizer_state_the_moments_and_step_are_zero(zero0_folder, tmp_path):
    source, _, _ = zero0_folder
    out = checkpoints.convert_to_dcp(source, tmp_path / "reset.ckpt", optimizer_state=False)
    fresh = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=1)
    optim = fresh.configure_optimizers()
    meta = checkpoints.load_sharded_checkpoint(out, fresh, [optim])
    assert meta["lightning_parallel"]["source"].endswith("optimizer reset")
    for param in fresh.parameters():
        assert float(optim.state[param]["step"]) == 0 and not optim.state[param]["exp_avg"].any()


def test_a_folder_not_written_by_lightning_converts_weights_only(tmp_path):
    module, optim = trained_module()
    source = write_zero0_folder(tmp_path / "engine_only", module, optim, lightning=False, prefix="_forward_module.")
    with pytest.raises(ValueError, match="not written by trainer.save_checkpoint"):
        checkpoints.convert_to_dcp(source, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / ".out.ckpt.partial").exists()
    out = checkpoints.convert_checkpoint(source / "checkpoint", tmp_path / "weights.pt")  # the tag folder works too
    plain = torch.load(out, weights_only=True)
    assert list(plain) == list(module.state_dict())  # the old wrapper prefix is stripped
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain[name], value, rtol=0, atol=0)
