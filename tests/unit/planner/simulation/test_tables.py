"""A TorchRec world from its plan's shards: fused optimizer state per shard, the whole-world check over tables, and
each rank's bytes (tables, dense part, DDP's gradients, the dense optimizer's measured state)."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from torch import nn

from lightning_parallel.planner.simulation.tables import TableShard, check_tables, fused_state_bytes, simulate_tables
from lightning_parallel.planner.simulation.whole_world import WholeWorldError


def shard(table="t", rank=0, row=0, col=0, rows=10, cols=4, kind="table_wise", fused="EXACT_ADAGRAD"):
    return TableShard(table, kind, rank, row, col, rows, cols, 4, fused)


def test_fused_optimizer_state_per_shard():
    assert fused_state_bytes(shard(fused="EXACT_ADAGRAD")) == 10 * 4 * 4  # one sum per element
    assert fused_state_bytes(shard(fused="EXACT_ROWWISE_ADAGRAD")) == 10 * 4  # one per row
    assert fused_state_bytes(shard(fused="ADAM")) == 2 * 10 * 4 * 4
    assert fused_state_bytes(shard(fused="EXACT_SGD")) == 0
    with pytest.raises(ValueError, match="SHAMPOO"):
        fused_state_bytes(shard(fused="SHAMPOO"))


def test_the_whole_world_check_over_tables_catches_a_doubled_and_a_lost_shard():
    halves = [shard(rank=0, cols=2), shard(rank=1, col=2, cols=2)]  # column-wise: 2 + 2 columns
    assert check_tables(halves, {"t": (10, 4)}, 2) == 40
    with pytest.raises(WholeWorldError, match=r"held \[0, 2\] times"):
        check_tables([halves[0], replace(halves[1], col_offset=0)], {"t": (10, 4)}, 2)
    replicated = [shard(rank=r, kind="data_parallel", fused="") for r in range(3)]
    assert check_tables(replicated, {"t": (10, 4)}, 3) == 40
    with pytest.raises(WholeWorldError, match="held by no rank"):
        check_tables(halves, {"t": (10, 4), "u": (5, 4)}, 2)


class Recsys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.empty(10, 4))
        self.dense = nn.Linear(4, 2)

    def configure_optimizers(self):
        return torch.optim.Adam(self.dense.parameters())


def test_each_rank_holds_its_shards_the_dense_part_and_the_state_of_both():
    with torch.device("meta"):
        module = Recsys()
    shards = [shard(rank=0, rows=6), shard(rank=1, row=6, rows=4), shard("u", rank=0, rows=3, kind="data_parallel",
                                                                         fused=""),
              shard("u", rank=1, rows=3, kind="data_parallel", fused="")]
    simulation = simulate_tables(module, shards, {"t": (10, 4), "u": (3, 4)}, 2,
                                 table_parameters={id(module.table)},
                                 twins={"u": partial(torch.optim.Adagrad, lr=0.1)})
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    dense, adam = 40, 2 * 40 + 2 * 4  # 10 weights and biases in fp32; exp_avg, exp_avg_sq and a step per tensor
    assert by_rank[0].parameter_bytes == dense + 6 * 16 + 3 * 16 and by_rank[1].parameter_bytes == dense + 4 * 16 + 48
    assert by_rank[0].gradient_bytes == dense + 48  # the dense part and the replicated table, in DDP's buckets
    assert by_rank[0].optimizer_bytes == adam + 6 * 16 + (48 + 4)  # fused Adagrad; the twin's sum and step
    assert len(simulation.classes) == 2 and simulation.elements_checked == 40 + 12
