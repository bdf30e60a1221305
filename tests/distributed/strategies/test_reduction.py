"""``reduce`` of the suite's strategies: Lightning's values, operator for operator, with one collective and not two
(Lightning's own runs a barrier before every all-reduce)."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.strategies.reduction import reduce_tensor
from lightning_parallel.testing import run_processes

pytestmark = pytest.mark.slow


def _reduce(rank: int, world_size: int) -> dict:
    from lightning.fabric.utilities.distributed import _sync_ddp

    from benchmarks.comm import CommCounter

    dist.init_process_group("gloo")
    out = {}
    for op in ("mean", "sum", "max", dist.ReduceOp.MIN):
        for dtype in (torch.float32, torch.int64):
            value = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=dtype)
            with CommCounter() as ours:
                mine = reduce_tensor(value.clone(), None, op)
            with CommCounter() as lightnings:
                theirs = _sync_ddp(value.clone(), None, op)
            out[f"{op}/{dtype}"] = (mine.tolist(), theirs.tolist(), mine.dtype == theirs.dtype,
                                    dict(ours.counts), dict(lightnings.counts))
    return out


def test_reduce_gives_lightnings_values_with_one_all_reduce_and_no_barrier():
    for results in run_processes(_reduce, 2, timeout=120):
        for case, (mine, theirs, same_dtype, ours, lightnings) in results.items():
            assert mine == theirs and same_dtype, case
            assert ours == {"all_reduce": 1}, (case, ours)
            assert lightnings == {"all_reduce": 1, "barrier": 1}, (case, lightnings)


def test_a_value_that_is_not_a_tensor_or_a_run_without_a_group_is_returned_as_it_is():
    assert reduce_tensor(3.0) == 3.0
    value = torch.tensor([1.0])
    assert reduce_tensor(value) is value  # no process group in this process
