"""``offload``: FSDP2's CPUOffloadPolicy under ZeRO 2/3, what is refused, and what it does on a CPU device."""

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from lightning_parallel.layout import DATA_PARALLEL
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.data import offload_policy, shard_data_axis
from lightning_parallel.parallel.options import OFFLOAD_DESCRIPTIONS, OFFLOAD_MODES, ParallelOptions
from lightning_parallel.testing.models import ResidualMLP


def _recording_fully_shard(monkeypatch):
    """Record the offload policy of every ``fully_shard`` call (FSDP2's own function still runs)."""
    import torch.distributed.fsdp as fsdp

    policies = []
    original = fsdp.fully_shard

    def record(module, **kwargs):
        policies.append(kwargs.get("offload_policy"))
        return original(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", record)
    return policies


def test_default_is_none_and_params_runs_under_zero_2_and_3():
    assert ParallelOptions().offload == "none"
    for stage in (2, 3):
        assert ParallelOptions(zero_stage=stage, offload="params").offload == "params"
    assert set(OFFLOAD_DESCRIPTIONS) == set(OFFLOAD_MODES)
    assert ParallelOptions(zero_stage=3).settings != ParallelOptions(zero_stage=3, offload="params").settings


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"zero_stage": 3, "offload": "optimizer"},
         r"offload='optimizer' has no FSDP2 form.*no optimizer-state-only policy.*Use offload='params'.*"
         r"strategy.offload_optimizer=true"),
        ({"zero_stage": 3, "offload": "cpu"}, r"Unknown offload='cpu': use one of \('none', 'params'\)"),
        ({"offload": "params"}, r"zero_stage=0 keeps the whole model.*Use zero_stage=3 \(or 2\), or offload='none'"),
        ({"offload": "optimizer"}, r"offload='optimizer' has no FSDP2 form"),
    ],
)
def test_refused_offloads_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelOptions(**kwargs)


def test_policy_per_mode_and_device():
    assert type(offload_policy("none", "cuda")) is OffloadPolicy
    assert offload_policy("params", "cuda") == CPUOffloadPolicy(pin_memory=True)
    # Pinning needs an accelerator: on a CPU-only build fully_shard refuses CPUOffloadPolicy(pin_memory=True).
    assert offload_policy("params", "cpu") == CPUOffloadPolicy(pin_memory=False)
    with pytest.raises(ValueError, match="use 'none' or 'params'"):
        offload_policy("optimizer", "cpu")


def test_shard_data_axis_gives_every_unit_the_policy(world_of_one, monkeypatch):
    policies = _recording_fully_shard(monkeypatch)
    _, mesh = world_of_one
    module = ResidualMLP(width=8, depth=2)
    shard_data_axis(module.pipeline_layers(), [module], mesh.mesh(DATA_PARALLEL), 3, offload="params")
    assert len(policies) == len(module.pipeline_layers()) + 1  # every layer, then the root
    assert all(p == CPUOffloadPolicy(pin_memory=False) for p in policies)


@pytest.mark.parametrize("stage", [2, 3])
def test_parallelize_offloads_and_trains_as_without_on_a_cpu_device(world_of_one, monkeypatch, stage):
    """On a CPU mesh the policy is applied (FSDP2's offload code path runs) and the numbers do not change."""
    policies = _recording_fully_shard(monkeypatch)
    layout, mesh = world_of_one
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    results = {}
    for offload in ("none", "params"):
        torch.manual_seed(0)
        module = ResidualMLP(width=16, depth=2)
        policies.clear()
        parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1, zero_stage=stage,
                                                                 offload=offload), adapter=adapt(module))
        expected = OffloadPolicy() if offload == "none" else CPUOffloadPolicy(pin_memory=False)
        assert policies and all(p == expected for p in policies), f"offload={offload!r}: {policies}"
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        for _ in range(3):
            torch.nn.functional.mse_loss(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert all(s.device.type == "cpu" for state in optimizer.state.values() for s in state.values()
                   if isinstance(s, torch.Tensor))
        results[offload] = [p.full_tensor().detach().clone() for p in module.parameters()]
    for off, on in zip(results["none"], results["params"]):
        torch.testing.assert_close(on, off, rtol=0, atol=0)
