"""Context parallelism: one sequence split over the ranks of a context group, attention kept exact.

* :mod:`.sharding` -- head-tail chunks for causal load balancing: which positions a rank holds,
  sharding a tensor and gathering it back;
* :mod:`.masks` -- causal, sliding-window, padding and packed-document rules over global positions;
* :mod:`.ring` -- ring attention: key/value blocks travel around the group (no head constraint);
* :mod:`.ulysses` -- all-to-all from sequence shards to head shards around a local attention kernel.

Pure torch and ``torch.distributed``: the process group is always an argument.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.context.masks import AttentionMask, documents_from
from lightning_parallel.parallel.context.ring import ring_attention
from lightning_parallel.parallel.context.sharding import (
    check_positions,
    check_sequence,
    gather_sequence,
    local_positions,
    shard_sequence,
)
from lightning_parallel.parallel.context.ulysses import LocalAttention, check_heads, exact_attention, ulysses_attention

METHODS = ("ring", "ulysses")


def context_attention(
    method: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    mask: AttentionMask,
    group: Optional[dist.ProcessGroup],
    *,
    scale: float,
    softcap: Optional[float] = None,
    local_attention: Optional[LocalAttention] = None,
) -> Tensor:
    """:func:`ring_attention` or :func:`ulysses_attention`, by name.

    Args:
        method: ``"ring"`` or ``"ulysses"``.
        q: this rank's queries ``[batch, q_heads, s_local, head_dim]``.
        k: this rank's keys ``[batch, kv_heads, s_local, head_dim]``.
        v: this rank's values ``[batch, kv_heads, s_local, value_dim]``.
        positions: ``local_positions(S, cp, cp_rank)``.
        mask: which keys each query may see.
        group: the context-parallel process group.
        scale: the factor of ``q @ k^T``.
        softcap: Gemma-2 logit soft-capping; None for none.
        local_attention: the kernel Ulysses runs over the whole sequence; ignored by ring, whose
            blockwise math is its own.

    Returns:
        ``[batch, q_heads, s_local, value_dim]`` in q's dtype.
    """
    if method == "ring":
        return ring_attention(q, k, v, positions, mask, group, scale=scale, softcap=softcap)
    if method == "ulysses":
        return ulysses_attention(
            q, k, v, positions, mask, group, scale=scale, softcap=softcap, local_attention=local_attention
        )
    raise ValueError(f"context_parallel_method={method!r} is not one of {METHODS}: use 'ring' or 'ulysses'.")


__all__ = [
    "METHODS", "AttentionMask", "LocalAttention", "check_heads", "check_positions", "check_sequence",
    "context_attention", "documents_from", "exact_attention", "gather_sequence", "local_positions",
    "ring_attention", "shard_sequence", "ulysses_attention",
]
