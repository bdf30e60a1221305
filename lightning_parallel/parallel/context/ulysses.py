"""Ulysses (DeepSpeed) sequence parallelism: trade sequence shards for head shards around a local attention.

Note:
    An all-to-all turns ``[b, heads, S / cp, d]`` on every rank into ``[b, heads / cp, S, d]``:
    each rank then runs an ordinary attention kernel over the whole sequence for its share of
    the heads, and a second all-to-all brings the output back to sequence shards. Two
    all-to-alls of activations per layer, independent of ``cp`` in volume per rank, against
    ring attention's ``cp - 1`` key/value transfers; but the head count must split over the
    context ranks, and the local kernel holds the full sequence (its ``S x S`` scores too,
    unless it is a fused kernel).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.parallel.context.masks import AttentionMask
from lightning_parallel.parallel.context.ring import check_attention_inputs
from lightning_parallel.parallel.context.sharding import check_positions

LocalAttention = Callable[[Tensor, Tensor, Tensor, Optional[Tensor], float], Tensor]


def check_heads(q_heads: int, kv_heads: int, cp_size: int, tensor_size: int = 1) -> None:
    """Raise unless Ulysses can split the attention heads over the context ranks.

    Args:
        q_heads: the model's query heads.
        kv_heads: the model's key/value heads (``q_heads % kv_heads == 0``).
        cp_size: the number of context-parallel ranks.
        tensor_size: the number of tensor-parallel ranks, which split the heads first.

    Raises:
        ValueError: the query heads left on a tensor rank do not divide by ``cp_size``.
    """
    if q_heads % kv_heads != 0:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}.")
    if q_heads % tensor_size != 0:
        raise ValueError(f"q_heads={q_heads} does not split over tensor_parallel_size={tensor_size}.")
    local = q_heads // tensor_size
    if local % cp_size != 0:
        where = f" ({q_heads} / tensor_parallel_size={tensor_size} per tensor rank)" if tensor_size > 1 else ""
        raise ValueError(
            f"context_parallel_method='ulysses' splits the {local} query heads{where} over "
            f"context_parallel_size={cp_size} ranks, which does not divide them: choose a context_parallel_size "
            f"that divides {local}, or context_parallel_method='ring', which has no head constraint."
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal pieces of dim 0; its adjoint is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _exchange(x: Tensor, group: Optional[dist.ProcessGroup], cp: int) -> Tensor:
    # Piece j of dim 0 goes to rank j, piece j of the result came from rank j.
    return x if cp == 1 else _AllToAll.apply(x, group)


def _sequence_to_heads(x: Tensor, group: Optional[dist.ProcessGroup], cp: int) -> Tensor:
    """``[b, h, S/cp, d]`` in local head-tail order -> ``[b, h/cp, S, d]`` in global order 0..S-1."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # piece j: head group j, for rank j
    recv = _exchange(send, group, cp).reshape(cp, b, h // cp, 2, s // 2, d)  # piece j: rank j's two chunks
    # Rank j holds global chunks j and 2cp-1-j: the heads in rank order, then the tails in reverse.
    chunks = torch.cat([recv[:, :, :, 0], recv[:, :, :, 1].flip(0)], dim=0)  # [2cp, b, h/cp, c, d]
    return chunks.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_sequence(y: Tensor, group: Optional[dist.ProcessGroup], cp: int) -> Tensor:
    """``[b, h/cp, S, d]`` in global order -> ``[b, h, S/cp, d]`` in this rank's head-tail order."""
    b, hl, seq, d = y.shape
    c = seq // (2 * cp)
    chunks = y.reshape(b, hl, 2 * cp, c, d).permute(2, 0, 1, 3, 4)  # [2cp, b, h/cp, c, d]
    send = torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=3).reshape(cp, b, hl, 2 * c, d)  # piece j: rank j's
    recv = _exchange(send, group, cp)  # piece j: head group j of this rank's tokens
    return recv.transpose(0, 1).reshape(b, cp * hl, 2 * c, d)


def _repeat_kv(t: Tensor, q_heads: int) -> Tensor:
    return t if t.size(1) == q_heads else t.repeat_interleave(q_heads // t.size(1), dim=1)


def exact_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: float, softcap: Optional[float] = None
) -> Tensor:
    """Attention over a whole sequence in which a query that sees no key gets output 0 (SDPA gives NaN there).

    Without ``softcap`` it is ``scaled_dot_product_attention`` (a fused kernel where the device
    has one); with it, an eager float32 softmax. A row with no visible key is given one so the
    softmax stays finite, and its output is then zeroed: its gradient is 0, not NaN.

    Args:
        q: ``[b, q_heads, S, d]``.
        k: ``[b, kv_heads, S, d]`` (``q_heads % kv_heads == 0``; repeated as ``repeat_kv`` does).
        v: ``[b, kv_heads, S, dv]``.
        allowed: bool, broadcastable to ``[b, 1, S, S]`` (True: may attend); None for none masked.
        scale: the factor of ``q @ k^T``.
        softcap: ``softcap * tanh(scores / softcap)`` before the mask; None for none.

    Returns:
        ``[b, q_heads, S, dv]`` in q's dtype.
    """
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    visible = None if allowed is None else allowed.any(dim=-1, keepdim=True)
    if allowed is not None:
        allowed = allowed | ~visible
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    else:
        dtype = torch.promote_types(q.dtype, torch.float32)  # softmax of low-precision scores loses small terms
        scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v.to(dtype)).to(q.dtype)
    return out if visible is None else out.masked_fill(~visible, 0)


def ulysses_attention(
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
    """Exact attention of this rank's tokens by all-to-all from sequence shards to head shards and back.

    Args:
        q: this rank's queries ``[batch, q_heads, s_local, head_dim]`` (``q_heads % cp == 0``).
        k: this rank's keys ``[batch, kv_heads, s_local, head_dim]``. When ``kv_heads % cp != 0``
            k and v are first repeated to ``q_heads`` heads, which costs ``q_heads / kv_heads``
            times their memory and all-to-all volume.
        v: this rank's values ``[batch, kv_heads, s_local, value_dim]``.
        positions: ``local_positions(S, cp, cp_rank)``: the global positions of this rank's tokens.
        mask: which keys each query may see; the full ``mask.block(arange(S), arange(S))`` is built.
        group: the context-parallel process group (one rank: no communication).
        scale: the factor of ``q @ k^T``.
        softcap: Gemma-2 logit soft-capping, applied by the default local attention only.
        local_attention: ``(q, k, v, allowed_or_None, scale) -> out [b, h, S, dv]`` over the whole
            sequence in global order, with k/v possibly having fewer heads than q (grouped-query);
            None for :func:`exact_attention`. It must give 0 for a row with no visible key.

    Returns:
        ``[batch, q_heads, s_local, value_dim]`` in q's dtype, in this rank's local order.
    """
    check_attention_inputs(q, k, v)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_heads(q.size(1), k.size(1), cp)
    seq_len = check_positions(positions, cp, rank)
    mask.check_shape(q.size(0), seq_len)
    if softcap is not None and local_attention is not None:
        raise ValueError("softcap is applied by the default local attention only: apply it inside local_attention "
                         "and pass softcap=None, or pass local_attention=None.")
    if k.size(1) % cp != 0:
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    qh, kh, vh = (_sequence_to_heads(t, group, cp) for t in (q, k, v))
    out = _attend(qh, kh, vh, mask, scale, softcap, local_attention)
    return _heads_to_sequence(out, group, cp).to(q.dtype)


def _attend(q, k, v, mask: AttentionMask, scale: float, softcap: Optional[float], local_attention) -> Tensor:
    """Attention over the whole sequence (global order) for this rank's heads."""
    full = torch.arange(q.size(2), device=q.device)
    if local_attention is not None:
        return local_attention(q, k, v, mask.block(full, full), scale)
    if softcap is None and mask.causal and mask.window is None and mask.documents is None:
        # Plain causal: is_causal lets SDPA pick a flash kernel that a materialised mask would rule out.
        k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return exact_attention(q, k, v, mask.block(full, full), scale, softcap)
