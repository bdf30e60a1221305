"""Capacity dropping decided over a group of ranks exactly as one process decides it on their whole batch.

Note:
    Setting: the ranks of ``group`` hold different tokens (data ranks, which expert parallelism borrows), and
    the reference is one process running the concatenation of their batches in group-rank order. An expert's
    capacity is ``capacity(T)`` copies for a batch of ``T`` tokens, and one process keeps, per expert, the
    copies of the lowest token indices.

    Proof that :func:`global_keep` gives the same drop set. Routing is per token, so in the concatenated batch
    the copies sent to expert ``e`` are rank 0's (in token order), then rank 1's, and so on. Rank ``q``'s
    ``c[q, e]`` copies therefore occupy the positions ``[B, B + c[q, e])`` of expert ``e``'s queue, with
    ``B = sum_{q' < q} c[q', e]``; one process keeps the positions below ``cap = capacity(sum_q T_q)``, which are
    the first ``clamp(cap - B, 0, c[q, e])`` of rank ``q``'s copies in token order -- what rank ``q`` keeps. The
    drops summed over ranks, ``sum_e (C_e - min(C_e, cap))``, are one process's count. Each rank needs every
    rank's counts and token count: one ``all_gather`` of ``E + 1`` integers before the rows travel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

Capacity = Callable[[int], int]  # tokens of the whole batch -> copies one expert takes


def global_keep(counts: Tensor, tokens: int, capacity: Capacity, group: dist.ProcessGroup) -> Tensor:
    """Copies this rank keeps per expert so that the group drops what one process drops on the whole batch.

    Args:
        counts: ``[E]`` this rank's copies routed to each expert (integer).
        tokens: this rank's tokens.
        capacity: copies one expert takes from a batch of the given number of tokens.
        group: the ranks whose concatenated batches (in group-rank order) are the one-process batch.
    """
    mine = torch.cat([counts, counts.new_tensor([tokens])])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered)
    return kept_of_rank(table[:, :-1], capacity(int(table[:, -1].sum())), dist.get_rank(group))


def kept_of_rank(counts: Tensor, capacity: int, rank: int) -> Tensor:
    """``[E]`` copies rank ``rank`` keeps when the ranks' queues are concatenated in rank order (module Note).

    Args:
        counts: ``[ranks, E]`` every rank's copies routed to each expert.
        capacity: copies one expert takes from the whole batch.
        rank: the rank asking.
    """
    before = counts[:rank].sum(0)
    return (capacity - before).clamp(min=0).minimum(counts[rank])


def kept_copies(expert_ids: Tensor, counts: Tensor, kept: Tensor) -> Tensor:
    """Indices of the copies that run, sorted by (expert, token): the first ``kept[e]`` copies of each expert.

    Args:
        expert_ids: ``[n * k]`` the expert of each copy, token-major (copy ``j`` is token ``j // k``).
        counts: ``[E]`` copies per expert.
        kept: ``[E]`` copies kept per expert (``counts`` itself when dropless).
    """
    order = torch.argsort(expert_ids, stable=True)  # stable: by token index within an expert
    if kept is counts:
        return order
    expert = expert_ids[order]
    position = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[expert]
    return order[position < kept[expert]]
