"""The suite's DCP folder on one process: exact round trip, atomic replacement, crash fallback, refusals."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from lightning_parallel.checkpoints import (
    METADATA_FILE,
    CheckpointRefused,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    partial_path,
    resolve_checkpoint,
    save_on_one_process,
)
from lightning_parallel.testing.models import ResidualMLP

from .conftest import LIGHTNING_STATE, STEPS, WIDTH

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:Detected pickle protocol")]  # the tampered meta.pt


def _fresh(seed: int = 1) -> tuple[ResidualMLP, torch.optim.Optimizer]:
    module = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=seed)
    return module, module.configure_optimizers()


def test_weights_optimizer_state_and_lightning_state_round_trip_exactly(dcp_folder):
    path, source, source_optim = dcp_folder
    assert is_sharded_checkpoint(path) and not partial_path(path).exists()
    module, optim = _fresh()
    meta = load_sharded_checkpoint(path, module, [optim])
    assert meta == LIGHTNING_STATE
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, source.state_dict()[name], rtol=0, atol=0)
    by_name = dict(source.named_parameters())
    for name, param in module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optim.state[param][key], source_optim.state[by_name[name]][key], rtol=0, atol=0)
        assert float(optim.state[param]["step"]) == STEPS
    assert optim.param_groups[0]["lr"] == source_optim.param_groups[0]["lr"]  # a byte entry, read weights_only


def test_saving_again_replaces_the_folder_and_leaves_no_hidden_folders(dcp_folder):
    path, module, _ = dcp_folder
    save_on_one_process(path, {"state_dict": module.state_dict()}, {"global_step": 99})
    assert torch.load(path / METADATA_FILE, weights_only=True) == {"global_step": 99}
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_stale_partial_folder_is_dropped_before_writing(dcp_folder):
    path, module, _ = dcp_folder
    partial_path(path).mkdir()
    (partial_path(path) / "junk").write_text("left by a crash")
    save_on_one_process(path, {"state_dict": module.state_dict()}, {})
    assert not partial_path(path).exists() and not (path / "junk").exists()


def test_a_crash_between_the_two_renames_falls_back_to_the_previous_checkpoint(dcp_folder):
    path, _, _ = dcp_folder
    old = path.with_name(f".{path.name}.old")
    path.rename(old)  # what commit() leaves if it dies after moving the old folder away
    assert resolve_checkpoint(path) == old and is_sharded_checkpoint(resolve_checkpoint(path))
    assert resolve_checkpoint(old) == old


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_parallel_pwned_unit",))


@pytest.mark.parametrize("target", [METADATA_FILE, ".metadata"])
def test_a_malicious_pickle_is_refused_without_running_it(dcp_folder, target):
    path, _, _ = dcp_folder
    with open(path / target, "wb") as f:
        pickle.dump(_Payload(), f)
    module, optim = _fresh()
    # Both files are read by the suite's allow-listed unpickler before DCP plans the load.
    with pytest.raises(CheckpointRefused, match="Refusing"):
        load_sharded_checkpoint(path, module, [optim])
    assert not os.path.exists("/tmp/lightning_parallel_pwned_unit")


def test_hydra_containers_in_hyperparameters_are_saved_as_plain_values_the_safe_reader_accepts(tmp_path):
    from omegaconf import OmegaConf

    module, optimizer = _fresh()
    overrides = OmegaConf.create({"num_hidden_layers": 4, "layer_types": ["full", "sliding"]})
    metadata = {"global_step": 7, "hyper_parameters": {"config_overrides": overrides, "lr": 1e-3}}
    path = save_on_one_process(tmp_path / "ckpt", {"state_dict": module.state_dict()}, metadata)
    loaded = load_sharded_checkpoint(path, _fresh(seed=2)[0], [])  # weights_only=True: OmegaConf objects are refused
    assert loaded["global_step"] == 7
    hparams = loaded["hyper_parameters"]
    assert hparams["lr"] == 1e-3
    assert hparams["config_overrides"] == {"num_hidden_layers": 4, "layer_types": ["full", "sliding"]}
    assert type(hparams["config_overrides"]) is dict and type(hparams["config_overrides"]["layer_types"]) is list
    assert OmegaConf.is_config(metadata["hyper_parameters"]["config_overrides"])  # the caller's dict is untouched


def test_a_tied_weight_is_checked_under_the_name_its_optimizer_state_is_saved_by():
    """A tied LM head shares the embedding's tensor; torch.distributed.checkpoint files its param-group settings under
    the first name. Looked up under the last one (the head's), they were missing and every resume of a tied model in
    a group of its own failed as a param-group mismatch (StarCoder2 through lp-train)."""
    from torch import nn

    from lightning_parallel.checkpoints import optimizer_state_dict
    from lightning_parallel.checkpoints.dcp import check_group_agreement

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    module = TiedLM()
    optimizer = torch.optim.AdamW([{"params": [module.proj.weight], "weight_decay": 0.1},
                                   {"params": [module.embed.weight, module.proj.bias], "weight_decay": 0.0}])
    flat = optimizer_state_dict(module, optimizer)
    assert "param_groups.embed.weight.weight_decay" in flat and "param_groups.head.weight.weight_decay" not in flat
    check_group_agreement(module, optimizer, flat)
    flat["param_groups.proj.bias.weight_decay"] = 0.1  # a real disagreement is still refused
    with pytest.raises(ValueError, match="Param-group mismatch: group 1 .*'embed.weight' and 'proj.bias'"):
        check_group_agreement(module, optimizer, flat)
