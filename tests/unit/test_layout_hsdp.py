"""The HSDP split of the data axis: resolution, validation with remedies, rank placement, option checks."""

import pytest

from lightning_parallel.layout import DATA_PARALLEL, DATA_REPLICATE, DATA_SHARD, ParallelLayout
from lightning_parallel.layout.meshes import data_mesh_shape
from lightning_parallel.parallel.data import uses_data_axis
from lightning_parallel.parallel.options import ParallelOptions


@pytest.mark.parametrize(
    ("split", "expected"),
    [
        ({}, (1, 4)),
        ({"data_shard": 2}, (2, 2)),
        ({"data_replicate": 4}, (4, 1)),
        ({"data_replicate": 2, "data_shard": 2}, (2, 2)),
    ],
)
def test_resolve_splits_the_data_axis_into_replicas_times_shards(split, expected):
    layout = ParallelLayout.resolve(8, pipeline_parallel=2, **split)
    assert (layout.data_replicate, layout.data_shard) == expected
    assert layout.data_parallel == 4  # the global batch still counts both dims
    assert layout.hsdp_enabled == (expected == (2, 2))


@pytest.mark.parametrize(
    ("split", "fix"),
    [
        (
            {"data_shard": 3},
            r"data_shard=3 does not divide the data axis data_parallel=4.*data_replicate x data_shard = 4",
        ),
        ({"data_replicate": 2, "data_shard": 4}, r"= 8, but the data axis is data_parallel=4.*product is 4"),
        ({"data_replicate": 0}, "must be >= 1"),
    ],
)
def test_a_split_that_does_not_fit_the_data_axis_names_the_fix(split, fix):
    with pytest.raises(ValueError, match=fix):
        ParallelLayout.resolve(4, **split)


def test_shard_groups_are_neighbouring_data_ranks_and_replica_groups_span_them():
    layout = ParallelLayout.resolve(8, pipeline_parallel=2, data_shard=2)  # data 4 = 2 replicas x 2 shards
    assert layout.group_ranks(DATA_PARALLEL, 0) == [0, 2, 4, 6]
    assert layout.group_ranks(DATA_SHARD, 0) == [0, 2] and layout.group_ranks(DATA_SHARD, 5) == [5, 7]
    assert layout.group_ranks(DATA_REPLICATE, 0) == [0, 4] and layout.group_ranks(DATA_REPLICATE, 3) == [3, 7]
    assert layout.data_coordinates(6) == (1, 1)
    assert layout.describe() == "dp4(2x2) x pp2 x tp1"


def test_unflattened_mesh_places_ranks_as_the_layout_says(tmp_path):
    import torch.distributed as dist

    from lightning_parallel import _compat
    from lightning_parallel.layout import DATA_AXES
    from lightning_parallel.layout.meshes import RunMeshes

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layout = ParallelLayout(1, 1, 1, 1)
        mesh = RunMeshes.build(layout, "cpu").root
        data = _compat.unflatten_mesh_dim(mesh, DATA_PARALLEL, (1, 1), DATA_AXES)
        assert data.mesh_dim_names[:2] == DATA_AXES and data._get_root_mesh() is mesh._get_root_mesh()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("zero_stage", "split", "shape"),
    [(0, {}, (4, 1)), (2, {}, None), (3, {"data_replicate": 2}, (2, 2)), (2, {"data_replicate": 4}, None)],
)
def test_fsdp2_gets_a_two_dimensional_data_mesh_only_when_replicating(zero_stage, split, shape):
    layout = ParallelLayout(4, 4, 1, 1, **split)
    assert data_mesh_shape(layout, zero_stage) == shape
    assert uses_data_axis(layout, zero_stage)
    assert not uses_data_axis(ParallelLayout(2, 1, 2, 1), 0)  # no data axis, nothing to reduce


def test_hsdp_sizes_with_replicated_data_parallelism_are_refused():
    with pytest.raises(ValueError, match=r"data_shard_size=2 splits the data axis for HSDP.*Fix: zero_stage=2 or 3"):
        ParallelOptions(data_parallel_size=4, data_shard_size=2)
    assert ParallelOptions(zero_stage=2, data_shard_size=2).data_shard_size == 2


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("powersgd", r"PowerSGD needs DDP's reducer.*FSDP2.*no communication hooks"),
        ("fp16", "overflow without loss scaling"),
        ("int8", "Unknown comm_hook"),
    ],
)
def test_comm_hooks_without_an_fsdp2_form_are_refused_with_the_reason(hook, message):
    with pytest.raises(ValueError, match=message):
        ParallelOptions(comm_hook=hook)


def test_the_bf16_comm_hook_is_fsdp2s_bf16_reduction():
    assert ParallelOptions(comm_hook="bf16").reduce_dtype == "bfloat16"
    assert ParallelOptions().reduce_dtype == "float32"


def test_the_startup_table_shows_shard_and_replica_groups_under_hsdp():
    from lightning_parallel.layout.rows import rank_map_rows

    rows = rank_map_rows(ParallelLayout.resolve(8, pipeline_parallel=2, data_shard=2))
    assert rows["data shard groups"].startswith("[0, 2] [1, 3]") and rows["data replica groups"].startswith("[0, 4]")
    assert "data shard groups" not in rank_map_rows(ParallelLayout.resolve(8, pipeline_parallel=2))
