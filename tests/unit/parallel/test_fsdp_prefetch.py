"""FSDP2 explicit prefetch (``fsdp_prefetch``): which units each layer prefetches, and when the option is refused."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.testing.models import ResidualMLP


def _recording(monkeypatch, name):
    calls = {}
    original = getattr(FSDPModule, name)

    def record(self, modules):
        calls[id(self)] = [id(m) for m in modules]
        return original(self, modules)  # FSDP2's own setter still runs (and checks its arguments)

    monkeypatch.setattr(FSDPModule, name, record)
    return calls


def test_each_layer_prefetches_the_next_two_in_forward_and_the_previous_two_in_backward(world_of_one, monkeypatch):
    forward = _recording(monkeypatch, "set_modules_to_forward_prefetch")
    backward = _recording(monkeypatch, "set_modules_to_backward_prefetch")
    layout, mesh = world_of_one
    module = ResidualMLP(width=16, depth=3)
    x = torch.randn(4, 16)
    expected = module(x)
    layers = module.pipeline_layers()  # inp, blocks 0-2, out: five FSDP2 units
    parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1, zero_stage=3, fsdp_prefetch=2),
                adapter=adapt(module))

    ids = [id(layer) for layer in layers]
    assert forward == {ids[0]: ids[1:3], ids[1]: ids[2:4], ids[2]: ids[3:5], ids[3]: [ids[4]]}
    assert backward == {ids[1]: [ids[0]], ids[2]: [ids[1], ids[0]], ids[3]: [ids[2], ids[1]], ids[4]: [ids[3], ids[2]]}
    assert id(module) not in forward  # the root keeps FSDP2's default
    torch.testing.assert_close(module(x), expected)


def test_without_the_option_fsdp2_keeps_its_defaults(world_of_one, monkeypatch):
    forward = _recording(monkeypatch, "set_modules_to_forward_prefetch")
    layout, mesh = world_of_one
    module = ResidualMLP(width=16, depth=2)
    parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1, zero_stage=3), adapter=adapt(module))
    assert forward == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fsdp_prefetch": 2}, r"zero_stage=0 keeps the whole model on every data rank.*zero_stage=2 or 3, or drop"),
        ({"fsdp_prefetch": 0, "zero_stage": 3}, r"fsdp_prefetch=0 must be an integer >= 1.*null for FSDP2's default"),
        ({"fsdp_prefetch": True, "zero_stage": 2}, r"fsdp_prefetch=True must be an integer"),
    ],
)
def test_prefetch_that_cannot_apply_is_refused_naming_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelOptions(**kwargs)
    assert ParallelOptions(zero_stage=2, fsdp_prefetch=1).fsdp_prefetch == 1
