"""Step 1b of ``parallelize`` on CPU: the chosen layers become torchao's ``Float8Linear`` (emulated off CUDA), the
kept ones stay as they were, a meta-built model is initialised as without FP8, and FP8 changes the numbers by FP8's
rounding (neither zero nor more); torchao's FP8 tensor styles replace torch's for converted layers only."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import BuildSettings, parallelize
from lightning_parallel.parallel.materialize import Materialization
from lightning_parallel.parallel.options import ParallelOptions

torchao = pytest.importorskip("torchao", reason="FP8 needs torchao: pip install 'lightning-parallel[float8]'")


def _meta_gpt(**overrides):
    from tests.distributed.parity_runs import tiny_gpt

    with torch.device("meta"):
        model = tiny_gpt(**overrides)
        model.configure_model()
    return model


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())


def _build(world_of_one, float8, **overrides):
    _, meshes = world_of_one
    model = _meta_gpt(**overrides)
    built = parallelize(model, meshes=meshes, options=ParallelOptions(data_parallel_size=1, float8=float8),
                        adapter=adapt(model), build=BuildSettings(materialization=Materialization(torch.device("cpu"),
                                                                                                   seed=3)))
    return model, built


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_chosen_layers_become_float8_linear_and_kept_ones_stay(world_of_one, recipe):
    from torchao.float8.float8_linear import Float8Linear

    model, built = _build(world_of_one, recipe, moe={"every": 2, "num_experts": 4, "top_k": 2})
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert {name for name, kind in kinds.items() if kind is Float8Linear} == set(built.float8.converted)
    assert set(built.float8.kept) == {"head.proj", "blocks.1.mlp.router"}
    assert all(kinds[name] is not Float8Linear for name in built.float8.kept)
    layer = model.get_submodule(built.float8.converted[0])
    assert layer.config.emulate and not layer.config.enable_fsdp_float8_all_gather  # CPU: torchao's emulation
    granularity = layer.config.cast_config_weight.scaling_granularity.value
    assert granularity == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]


def test_meta_built_fp8_model_starts_from_the_same_weights_and_differs_by_fp8_rounding(world_of_one):
    fp8, _ = _build(world_of_one, "tensorwise")
    import torch.distributed as dist

    from lightning_parallel.layout.meshes import RunMeshes

    plain = _meta_gpt()
    parallelize(plain, meshes=RunMeshes.build(world_of_one[0], "cpu"), options=ParallelOptions(data_parallel_size=1),
                adapter=adapt(plain), build=BuildSettings(materialization=Materialization(torch.device("cpu"), seed=3)))
    assert dist.is_initialized()
    for (name, a), (_, b) in zip(fp8.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name  # names unchanged by the conversion; initialised as without FP8
    idx = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    fp8_loss, loss = _loss(fp8, idx), _loss(plain, idx)
    fp8_loss.backward()
    assert all(p.grad is not None for p in fp8.parameters() if p.requires_grad)
    assert 1e-6 < abs(fp8_loss.item() - loss.item()) < 1e-2  # FP8 rounding: measured 2.7e-4


def test_fp8_tensor_styles_replace_torch_styles_of_converted_layers_only():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from lightning_parallel.parallel.float8.convert import float8_styles

    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(1)),
            "head": ColwiseParallel(output_layouts=Replicate())}
    styles = float8_styles(plan, ["up", "down"])  # the head was kept in high precision
    assert type(styles["up"]) is Float8ColwiseParallel and type(styles["down"]) is Float8RowwiseParallel
    assert styles["down"].output_layouts == (Shard(1),) and styles["down"].use_local_output
    assert styles["head"] is plan["head"]
