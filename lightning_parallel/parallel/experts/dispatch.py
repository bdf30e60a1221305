"""Token dispatch and combine over an expert group: all-to-all of variable split sizes, counts exchanged first.

The ``ep`` ranks of an expert group each hold ``E / ep`` consecutive experts (rank ``i``: experts
``[i E/ep, (i+1) E/ep)``) and different tokens. A rank sorts its token copies by destination expert, so the
copies for rank ``i`` are one consecutive block; it tells every rank how many copies it sends to each of that
rank's experts (an all-to-all of the counts), then sends the rows (an all-to-all with those split sizes). The
receiver regroups what came in by local expert (stable: by source rank, then in the sender's order), runs its
experts, and the results travel back by the inverse permutation and the inverse all-to-all.

Note:
    Differentiable end to end: :func:`all_to_all`'s backward is the same exchange with the split sizes swapped
    (``torch.distributed.nn.functional`` is deprecated in torch 2.13). The split sizes are Python ints (one host
    sync per exchange, as torchtitan and Megatron do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.experts.capacity import Capacity, global_keep, kept_copies


def _exchange(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """``all_to_all_single`` of rows with variable split sizes; its backward sends the gradients back.

    Args:
        x: ``[sum(input_splits), ...]`` rows, the block for rank ``i`` at position ``i``.
        output_splits: rows coming from each rank.
        input_splits: rows going to each rank.
        group: the process group.
    """
    return _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(counts: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[ep, E/ep]``: row ``q`` holds the copies rank ``q`` sends to each of this rank's experts.

    Args:
        counts: ``[E]`` copies this rank sends to each expert (experts sharded consecutively over the group).
        group: the expert group.
    """
    ep = dist.get_world_size(group)
    if counts.numel() % ep:
        raise ValueError(f"{counts.numel()} experts do not split over {ep} expert ranks: make ep divide them.")
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep, -1)


@dataclass(frozen=True)
class ExpertRoute:
    """How rows went out and came in, to send the results back.

    Args:
        input_splits: rows sent to each rank.
        output_splits: rows received from each rank.
        order: ``received[order]`` is sorted by local expert.
        local_counts: ``[E/ep]`` rows for each local expert.
    """

    input_splits: list[int]
    output_splits: list[int]
    order: Tensor
    local_counts: Tensor


def dispatch_sorted(rows: Tensor, counts: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, ExpertRoute]:
    """Send rows sorted by global expert to the ranks holding the experts; return them sorted by local expert.

    Args:
        rows: ``[sum(counts), d]`` token copies sorted by expert.
        counts: ``[E]`` rows per expert (integer).
        group: the expert group.

    Returns:
        ``(rows for this rank's experts, sorted by local expert; the route back)``.
    """
    received_counts = exchange_counts(counts, group)
    ep, local = received_counts.shape
    input_splits = counts.view(ep, local).sum(1).tolist()
    output_splits = received_counts.sum(1).tolist()
    received = all_to_all(rows, output_splits, input_splits, group)
    local_expert = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received_counts.flatten())
    order = torch.argsort(local_expert, stable=True)  # stable: by source rank, then in the sender's order
    return received[order], ExpertRoute(input_splits, output_splits, order, received_counts.sum(0))


def combine_sorted(out: Tensor, route: ExpertRoute, group: dist.ProcessGroup) -> Tensor:
    """The inverse of :func:`dispatch_sorted`: results back to the senders, in the order they sent the rows.

    Args:
        out: ``[rows, d]`` results in local-expert order.
        route: what :func:`dispatch_sorted` returned with the rows.
        group: the expert group.
    """
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    return all_to_all(out[inverse], route.input_splits, route.output_splits, group)


@dataclass(frozen=True)
class TokenRoute:
    """What :func:`dispatch` did to a batch of tokens, for :func:`combine`.

    Args:
        copies: indices ``t * k + j`` of the copies that ran, sorted by expert.
        top_k: experts per token.
        tokens: tokens of the batch.
        route: the rows' route through the expert group.
        dropped: copies over capacity (0-d).
    """

    copies: Tensor
    top_k: int
    tokens: int
    route: ExpertRoute
    dropped: Tensor


def dispatch(tokens: Tensor, expert_ids: Tensor, num_experts: int, group: dist.ProcessGroup,
             capacity: Optional[Capacity] = None, capacity_group: Optional[dist.ProcessGroup] = None,
             ) -> tuple[Tensor, Tensor, TokenRoute]:
    """Send each token to its ``k`` experts over the expert group.

    Args:
        tokens: ``[n, d]`` this rank's tokens.
        expert_ids: ``[n, k]`` the experts of each token.
        num_experts: ``E`` (consecutive blocks of ``E/ep`` per rank).
        group: the expert group.
        capacity: None for dropless, else copies one expert takes from a batch of ``T`` tokens
            (drops decided over ``capacity_group`` by :func:`global_keep`).
        capacity_group: the ranks whose batches together are the one-process batch (default ``group``).

    Returns:
        ``(rows for this rank's experts sorted by local expert, [E/ep] rows per local expert, the route)``.
    """
    flat = expert_ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    kept = counts if capacity is None else global_keep(counts, tokens.shape[0], capacity, capacity_group or group)
    copies = kept_copies(flat, counts, kept)
    rows, route = dispatch_sorted(tokens[copies // expert_ids.shape[1]], kept, group)
    return rows, route.local_counts, TokenRoute(copies, expert_ids.shape[1], tokens.shape[0], route,
                                                (counts - kept).sum())


def combine(out: Tensor, route: TokenRoute, weights: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[n, d]``: each token's expert results back from the expert group, summed with the router weights.

    Args:
        out: ``[rows, d]`` this rank's experts' results, in the order :func:`dispatch` returned the rows.
        route: what :func:`dispatch` returned.
        weights: ``[n, k]`` router weights.
        group: the expert group.
    """
    rows = combine_sorted(out, route.route, group)
    scaled = rows * weights.flatten()[route.copies, None].to(rows.dtype)
    return rows.new_zeros(route.tokens, rows.shape[-1]).index_add(0, route.copies // route.top_k, scaled)
