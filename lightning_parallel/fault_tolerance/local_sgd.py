"""``fault_tolerance.mode=local_sgd``: every group steps on its own batches and the groups average their parameters
every ``sync_every`` steps (Local SGD, Stich 2019; torchft's ``LocalSGD`` does the same average).

Written here rather than wrapping ``torchft.local_sgd.LocalSGD``: a group that restarts heals at the healthy
groups' next synchronisation, before its own loader exists (as under ``mode=ddp``), and must take part in that
very average without counting -- its parameters are a copy of one healthy group's, and counting them would weigh
that group twice. ``LocalSGD`` has no way to join an average without a contribution, so the average is a sum
with a count beside it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.fault_tolerance.flat_buffers import flatten_by_dtype, pieces
from lightning_parallel.fault_tolerance.replica_state import local


@torch.no_grad()
def average_parameters(manager: Any, params: list[torch.Tensor], contributes: bool) -> bool:
    """Average ``params`` (local shards) over the groups that contribute; commit or keep them as they were.

    Args:
        manager: the torchft manager (its quorum taken).
        params: this rank's trainable parameters, in the same order on every group.
        contributes: False for a group that has just healed from a peer (it joins the sum with zeros).

    Returns:
        Whether the average committed (else every group keeps its local parameters until the next sync).
    """
    from torch.distributed import ReduceOp

    shards = [local(p.data) for p in params]
    buffers = flatten_by_dtype(shards)
    device = shards[0].device if shards else torch.device("cpu")
    count = torch.tensor([1.0 if contributes else 0.0], device=device)
    if not contributes:
        for _, flat in buffers.values():
            flat.zero_()
    works = [manager.allreduce(count, reduce_op=ReduceOp.SUM)]
    works += [manager.allreduce(flat, reduce_op=ReduceOp.SUM) for _, flat in buffers.values()]
    for work in works:
        work.wait()
    if not manager.should_commit() or float(count) < 1:
        return False
    for idx, flat in buffers.values():
        for i, mean in zip(idx, pieces(flat / count.to(flat.dtype), [shards[i] for i in idx])):
            shards[i].copy_(mean)
    return True
