"""ParallelLayout: resolution, validation with remedies, and rank placement (no processes)."""

import pytest

from lightning_parallel.layout import DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL, ParallelLayout


@pytest.mark.parametrize(
    ("world", "sizes", "expected"),
    [
        (8, {}, (8, 1, 1)),
        (8, {"pipeline_parallel": 2}, (4, 2, 1)),
        (8, {"pipeline_parallel": 2, "tensor_parallel": 2}, (2, 2, 2)),
        (4, {"data_parallel": 1, "pipeline_parallel": "auto"}, (1, 4, 1)),
        (4, {"data_parallel": 2, "tensor_parallel": "auto"}, (2, 1, 2)),
        (1, {}, (1, 1, 1)),
    ],
)
def test_resolve_fills_auto_from_world_size(world, sizes, expected):
    layout = ParallelLayout.resolve(world, **sizes)
    assert layout.shape == expected
    assert layout.world_size == world


@pytest.mark.parametrize(
    ("world", "sizes", "fix"),
    [
        (8, {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1}, "product is 8"),
        (6, {"pipeline_parallel": 4}, "multiple of 4"),
        (4, {"data_parallel": "auto", "pipeline_parallel": "auto"}, "Only one size can be 'auto'"),
        (4, {"pipeline_parallel": 0}, "must be >= 1"),
        (4, {"tensor_parallel": -2}, "must be >= 1"),
        (4, {"tensor_parallel": 1.5}, "positive integer"),
        (4, {"tensor_parallel": True}, "positive integer"),
        (0, {}, "must be >= 1"),
    ],
)
def test_invalid_layouts_raise_value_error_naming_the_fix(world, sizes, fix):
    with pytest.raises(ValueError, match=fix):
        ParallelLayout.resolve(world, **sizes)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="world size"):
        ParallelLayout(world_size=4, data_parallel=2, pipeline_parallel=1, tensor_parallel=1)


def test_tensor_groups_are_contiguous_ranks_then_pipeline_then_data():
    layout = ParallelLayout.resolve(8, data_parallel=2, pipeline_parallel=2, tensor_parallel=2)
    assert layout.group_ranks(TENSOR_PARALLEL, 0) == [0, 1]
    assert layout.group_ranks(TENSOR_PARALLEL, 6) == [6, 7]
    assert layout.group_ranks(PIPELINE_PARALLEL, 0) == [0, 2]
    assert layout.group_ranks(PIPELINE_PARALLEL, 5) == [5, 7]
    assert layout.group_ranks(DATA_PARALLEL, 3) == [3, 7]
    assert layout.coordinates(5) == (1, 0, 1)


def test_coordinates_and_rank_at_are_inverse_and_cover_every_rank():
    layout = ParallelLayout.resolve(12, data_parallel=3, pipeline_parallel=2, tensor_parallel=2)
    seen = {layout.rank_at(*layout.coordinates(r)) for r in range(12)}
    assert seen == set(range(12))
    assert [r for r, _ in layout.rank_map()] == list(range(12))
    with pytest.raises(ValueError, match="outside"):
        layout.coordinates(12)


def test_layout_matches_init_device_mesh_placement():
    # init_device_mesh lays ranks out row-major over (data, pipeline, tensor): so must we.
    import torch

    layout = ParallelLayout.resolve(8, data_parallel=2, pipeline_parallel=2, tensor_parallel=2)
    mesh = torch.arange(8).view(layout.shape)
    for rank in range(8):
        assert tuple(mesh[layout.coordinates(rank)].tolist() for _ in [0])[0] == rank


def test_flags_and_description():
    layout = ParallelLayout.resolve(4, pipeline_parallel=2)
    assert layout.data_parallel_enabled and layout.pipeline_parallel_enabled and not layout.tensor_parallel_enabled
    assert layout.describe() == "dp2 x pp2 x tp1"
