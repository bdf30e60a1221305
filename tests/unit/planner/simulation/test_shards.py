"""The shard arithmetic lp-simulate groups ranks by: torch.chunk's pieces, nesting, and a rank's mesh coordinates."""

import pytest
import torch

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.planner.simulation.shards import ParamSpec, Split, chunk, rank_coordinates


@pytest.mark.parametrize("length,pieces", [(34, 4), (7, 8), (256, 8), (0, 2), (5, 1)])
def test_chunk_gives_torch_chunks_pieces_and_empty_tails(length, pieces):
    parts = torch.arange(length).tensor_split([min(i * -(-length // pieces), length) for i in range(1, pieces)])
    expected = [(int(p[0]) if len(p) else min(i * -(-length // pieces), length), len(p)) for i, p in enumerate(parts)]
    assert [chunk(length, pieces, i) for i in range(pieces)] == expected


def test_a_strided_fsdp_shard_splits_within_the_tensor_parallel_piece():
    """FSDP2 over a dimension tensor parallelism split first (its _StridedShard): the data shard is inside the TP
    piece, whatever the mesh order."""
    spec = ParamSpec("w", (256, 34), 4, (Split("data_parallel", 2, 0, strided=True), Split("tensor_parallel", 2, 0)))
    assert spec.region({"data_parallel": 1, "tensor_parallel": 1}) == ((192, 64), (0, 34))
    assert spec.pieces == 4


def test_coordinates_follow_the_meshes_runmeshes_builds():
    layout = ParallelLayout.resolve(32, 4, 2, 2, context_parallel=2, data_replicate=2, expert_parallel=4)
    where = rank_coordinates(layout, 3, layout.rank_at(3, 1, 0, 1))
    assert (where["data_context"], where["data_replicate"], where["data_shard"]) == (7, 1, 3)
    assert (where["expert_data"], where["expert_parallel"], where["pipeline_parallel"]) == (1, 3, 1)
