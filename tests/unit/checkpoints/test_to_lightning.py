"""Suite folder -> one Lightning checkpoint.

Optimizer state is keyed by index exactly as torch keys it, and the order is recovered.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.checkpoints import optimizer_state_dict, save_on_one_process
from lightning_parallel.checkpoints.lightning.writer import (
    _local_groups,
    _module_order,
    merge_parameter_groups,
    parameter_order_entry,
    to_lightning_checkpoint,
)
from lightning_parallel.cli.convert import main
from lightning_parallel.parallel.pipeline.stages import RemovedLayer
from lightning_parallel.testing.models import ResidualMLP

from .conftest import LIGHTNING_STATE, WIDTH

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _two_groups(module):
    """Weight decay on matrices only: two groups, each filtered from named_parameters in module order."""
    decay = [p for n, p in module.named_parameters() if p.dim() == 2]
    rest = [p for n, p in module.named_parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def _trained(groups=_two_groups, seed=0):
    module = ResidualMLP(width=WIDTH, depth=4, seed=seed)
    optim = groups(module)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x, y = torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)
        optim.zero_grad()
        F.mse_loss(module(x), y).backward()
        optim.step()
    return module, optim


def _stage(module, removed):
    """A copy of ``module`` as a pipeline rank holds it: ``removed`` layers replaced by RemovedLayer."""
    stage = copy.deepcopy(module)
    for name in removed:
        parent, _, leaf = name.rpartition(".")
        stage.get_submodule(parent).register_module(leaf, RemovedLayer(name, 1)) if parent else setattr(
            stage, leaf, RemovedLayer(name, 1))
    return stage


LAYERS = ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out"]


@pytest.mark.parametrize(
    "owned", [[LAYERS[:3], LAYERS[3:]], [LAYERS[0::2], LAYERS[1::2]]], ids=["contiguous", "interleaved"]
)
def test_the_unsplit_order_is_recovered_from_pipeline_stages(owned):
    module = ResidualMLP(width=WIDTH, depth=4)
    stages = [_stage(module, [layer for layer in LAYERS if layer not in mine]) for mine in owned]
    merged = merge_parameter_groups(
        [_module_order(s) for s in stages], [_local_groups(s, [_two_groups(s)]) for s in stages]
    )
    assert merged == _local_groups(module, [_two_groups(module)])


def test_an_order_that_is_not_module_order_under_pipeline_stages_is_unknowable():
    module = ResidualMLP(width=WIDTH, depth=4)
    stages = [_stage(module, LAYERS[3:]), _stage(module, LAYERS[:3])]
    backwards = lambda m: torch.optim.AdamW(list(m.parameters())[::-1])  # noqa: E731
    assert merge_parameter_groups(
        [_module_order(s) for s in stages], [_local_groups(s, [backwards(s)]) for s in stages]
    ) is None
    # Without pipeline stages every rank's own list is exact, whatever its order.
    assert merge_parameter_groups([_module_order(module)], [_local_groups(module, [backwards(module)])]) == [
        [[n for n, _ in module.named_parameters()][::-1]]]


def _suite_folder(path, module, optim, record=True):
    meta = dict(LIGHTNING_STATE, hyper_parameters={"width": WIDTH})
    meta["lightning_parallel"] = {"layout": (1, 1, 1), **(parameter_order_entry(module, [optim]) if record else {})}
    state = {"state_dict": module.state_dict(), "optimizer_0": optimizer_state_dict(module, optim)}
    return save_on_one_process(path, state, meta)


def test_the_converted_optimizer_state_is_torchs_own_state_dict_and_resumes_exactly(tmp_path, capsys):
    module, optim = _trained()
    folder = _suite_folder(tmp_path / "last.ckpt", module, optim)
    assert main([str(folder), str(tmp_path / "out.ckpt"), "--to", "lightning"]) == 0
    assert "optimizer(s), Lightning state at global step 2" in capsys.readouterr().out
    converted = torch.load(tmp_path / "out.ckpt", weights_only=True)
    # Of the suite's entries only the names of the param groups travel (read back by lp-convert, ignored by Lightning).
    assert converted["lightning_parallel"].keys() == {"param_groups"}
    assert converted["hyper_parameters"] == {"width": WIDTH}
    assert converted["loops"] == LIGHTNING_STATE["loops"] and converted["global_step"] == 2
    expected = optim.state_dict()
    (got,) = converted["optimizer_states"]
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)
    # A fresh module and optimizer loading the file continue exactly as the original.
    fresh, fresh_optim = ResidualMLP(width=WIDTH, depth=4, seed=3), None
    fresh.load_state_dict(converted["state_dict"])
    fresh_optim = _two_groups(fresh)
    fresh_optim.load_state_dict(got)
    x, y = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    for m, o in ((module, optim), (fresh, fresh_optim)):
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    for (name, a), b in zip(module.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_folder_without_the_recorded_order_is_refused_unless_the_optimizer_is_left_out(tmp_path, capsys):
    module, optim = _trained()
    folder = _suite_folder(tmp_path / "old.ckpt", module, optim, record=False)
    assert main([str(folder), str(tmp_path / "out.ckpt"), "--to", "lightning"]) == 2
    err = capsys.readouterr().err
    assert "by index in configure_optimizers order" in err and "--no-optimizer" in err
    assert not (tmp_path / "out.ckpt").exists()
    assert main([str(folder), str(tmp_path / "out.ckpt"), "--to", "lightning", "--no-optimizer"]) == 0
    converted = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert "optimizer_states" not in converted and converted["state_dict"].keys() == module.state_dict().keys()


def test_state_of_tied_copies_is_dropped_and_stray_state_refused(tmp_path):
    module, optim = _trained(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    folder = _suite_folder(tmp_path / "last.ckpt", module, optim)
    meta = torch.load(folder / "meta.pt", weights_only=True)
    names = meta["lightning_parallel"]["param_groups"][0][0]
    meta["lightning_parallel"]["param_groups"] = [[names[1:]]]  # the first weight is now unknown
    torch.save(meta, folder / "meta.pt")
    with pytest.raises(ValueError, match="belongs to no parameter of the recorded param groups"):
        to_lightning_checkpoint(folder)
    meta["lightning_parallel"]["tied_copies"] = [names[0]]  # ... unless it is a copy of a tied parameter
    torch.save(meta, folder / "meta.pt")
    (state,) = to_lightning_checkpoint(folder)["optimizer_states"]
    assert state["param_groups"][0]["params"] == list(range(len(names) - 1))


def test_a_lightning_dcp_folder_converts_with_the_order_its_nested_groups_name(tmp_path):
    """ModelParallelStrategy's layout: torch's nested optimizer state dict (groups list parameter names in order)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_parallel.checkpoints.detect import identify_writer

    module, optim = _trained()
    state = {"state_dict": module.state_dict(), "optimizer_0": get_optimizer_state_dict(module, optim)}
    folder = save_on_one_process(tmp_path / "mp.ckpt", state, dict(LIGHTNING_STATE))
    assert identify_writer(folder) == "lightning-dcp"
    assert main([str(folder), str(tmp_path / "out.ckpt"), "--to", "lightning"]) == 0
    (got,) = torch.load(tmp_path / "out.ckpt", weights_only=True)["optimizer_states"]
    expected = optim.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)
