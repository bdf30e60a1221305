"""``parallelize`` on a world of one process: the composition order's contract without a Trainer."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import check_module, is_parallelized, parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.testing.models import ResidualMLP


def test_a_world_of_one_leaves_the_module_whole(world_of_one):
    layout, mesh = world_of_one
    module = ResidualMLP(width=16, depth=2)
    before = {name: p for name, p in module.named_parameters()}
    result = parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1), adapter=adapt(module))
    assert not result.pipelined and result.plan == {} and result.stages == () and result.num_stages == 1
    assert {name: p for name, p in module.named_parameters()} == before  # same tensors, nothing wrapped
    assert not is_parallelized(module)


def test_zero3_on_a_world_of_one_shards_and_refuses_a_second_parallelize(world_of_one):
    layout, mesh = world_of_one
    module = ResidualMLP(width=16, depth=2)
    x = torch.randn(4, 16)
    expected = module(x)
    parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1, zero_stage=3), adapter=adapt(module))
    assert is_parallelized(module)
    torch.testing.assert_close(module(x), expected)
    with pytest.raises(ValueError, match="already split or sharded.*fresh module"):
        parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1), adapter=adapt(module))


def test_check_module_needs_no_process_group():
    assert not dist.is_initialized()
    layout = ParallelLayout.resolve(4, pipeline_parallel=2, tensor_parallel=2)
    plan = check_module(
        ResidualMLP(width=16, depth=4), layout, ParallelOptions(pipeline_parallel_size=2, tensor_parallel_size=2)
    )
    assert sorted(plan) == sorted(f"blocks.{i}.{name}" for i in range(4) for name in ("up", "down"))
    with pytest.raises(ValueError, match="fewer than the 8 stages"):
        check_module(ResidualMLP(width=16, depth=4), ParallelLayout.resolve(8, data_parallel=1, pipeline_parallel=8),
                     ParallelOptions(data_parallel_size=1, pipeline_parallel_size=8, microbatches=8))
