"""Ring attention: each rank keeps its queries and the key/value blocks travel around the context group.

Note:
    Why a hand-written ring: torch's own (``torch.distributed.tensor.experimental.context_parallel``;
    ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) only rewrites the
    CUDA SDPA kernels (``aten._scaled_dot_product_flash_attention``, ``_efficient_attention``,
    ``_cudnn_attention``), so it does nothing on CPU/gloo, and it takes ``is_causal`` alone:
    ``attn_bias`` raises ``NotImplementedError``, so padding, packed documents and sliding windows
    cannot be expressed. Here the mask is a rule over global positions (:class:`AttentionMask`),
    evaluated per block, and the math is plain matmuls that run on any device and backend.

    Memory: the forward saves this rank's q, k, v, the output and the float32 log-sum-exp;
    the backward sends the key/value blocks around the ring again, with their dK/dV
    accumulators, instead of keeping every block's scores (which would cost
    ``O(s_local * S)`` per head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_parallel.parallel.context.masks import AttentionMask
from lightning_parallel.parallel.context.sharding import check_positions, local_positions


@dataclass(frozen=True)
class _Ring:
    """Where this rank sits in the context group and what a block from another rank holds."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    seq_len: int

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.size)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The global chunk indices a rank holds, in local order."""
        return rank, 2 * self.size - 1 - rank

    def exchange(self, tensors: list[Tensor]) -> "_Pending":
        """Send ``tensors`` to the next rank and receive the previous rank's, without waiting."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = []
        for tag, (out, into) in enumerate(zip(tensors, received)):
            # A tag per tensor keeps same-shaped k and v apart on backends that match by tag (gloo).
            ops.append(dist.P2POp(dist.isend, out.contiguous(), group=self.group, group_peer=nxt, tag=tag))
            ops.append(dist.P2POp(dist.irecv, into, group=self.group, group_peer=prev, tag=tag))
        return _Pending(dist.batch_isend_irecv(ops), received)


@dataclass(frozen=True)
class _Pending:
    requests: list
    received: list[Tensor]

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


def _tiles(ring: _Ring, mask: AttentionMask, source: int) -> list[tuple[slice, slice]]:
    """(query slice, key slice) pairs of the block from ``source`` that may hold a visible pair.

    Each local sequence is two chunks; a (query chunk, key chunk) tile that the causal and
    window rules hide entirely is skipped. Under causal head-tail sharding that is half of
    every off-diagonal block and a quarter of the diagonal one.
    """
    c = ring.chunk
    spans = []
    for qc in ring.chunks(ring.rank):
        seen = [
            i for i, kc in enumerate(ring.chunks(source))
            if mask.may_attend(qc * c, qc * c + c - 1, kc * c, kc * c + c - 1)
        ]
        spans.append(slice(seen[0] * c, (seen[-1] + 1) * c) if seen else None)
    if spans[0] == spans[1]:
        return [] if spans[0] is None else [(slice(0, 2 * c), spans[0])]
    return [(slice(i * c, (i + 1) * c), span) for i, span in enumerate(spans) if span is not None]


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with -inf (a row that saw no key) replaced by 0, so ``exp(x - lse)`` gives 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _scores(q5: Tensor, k5: Tensor, allowed: Optional[Tensor], scale: float, softcap: Optional[float]):
    """Masked scores ``[b, kv_heads, group, s_q, s_k]`` and ``tanh(raw / softcap)`` (None without softcap)."""
    scores = torch.matmul(q5, k5.transpose(-1, -2)) * scale
    capped = None
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, capped


def _block_mask(mask: AttentionMask, q_pos: Tensor, k_pos: Tensor) -> Optional[Tensor]:
    allowed = mask.block(q_pos, k_pos)
    # [b, 1, s_q, s_k] -> [b, 1, 1, s_q, s_k]: broadcast over kv heads and the query heads sharing each.
    return None if allowed is None else allowed.unsqueeze(2)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's normalised output and log-sum-exp into the running ones, in place."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new_lse)


def _forward_block(state: dict, ring: _Ring, source: int, kv: list[Tensor]) -> None:
    """Attend this rank's queries to the key/value block of ``source``, merging into ``state``."""
    q5, out, lse, positions, mask = state["q5"], state["out"], state["lse"], state["positions"], state["mask"]
    k_pos = local_positions(ring.seq_len, ring.size, source, device=positions.device)
    k, v = (t.to(q5.dtype).unsqueeze(2) for t in kv)
    for qs, ks in _tiles(ring, mask, source):
        allowed = _block_mask(mask, positions[qs], k_pos[ks])
        scores, _ = _scores(q5[..., qs, :], k[..., ks, :], allowed, state["scale"], state["softcap"])
        block_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(block_lse).unsqueeze(-1))
        _merge(out[..., qs, :], lse[..., qs], torch.matmul(probs, v[..., ks, :]), block_lse)


def _backward_block(state: dict, ring: _Ring, source: int, kv: list[Tensor], dkv: list[Tensor]) -> None:
    """Add the gradient contributions of the block of ``source`` to dQ and to that block's dK/dV."""
    q5, do5, delta, lse, positions, mask = (state[n] for n in ("q5", "do5", "delta", "lse", "positions", "mask"))
    scale, softcap = state["scale"], state["softcap"]
    k_pos = local_positions(ring.seq_len, ring.size, source, device=positions.device)
    k, v = (t.to(q5.dtype).unsqueeze(2) for t in kv)
    for qs, ks in _tiles(ring, mask, source):
        allowed = _block_mask(mask, positions[qs], k_pos[ks])
        q_t, k_t, v_t, do_t = q5[..., qs, :], k[..., ks, :], v[..., ks, :], do5[..., qs, :]
        scores, capped = _scores(q_t, k_t, allowed, scale, softcap)
        # The saved log-sum-exp is over all blocks, so this is the final softmax restricted to the tile.
        probs = torch.exp(scores - _finite(lse[..., qs]).unsqueeze(-1))
        dkv[1][:, :, ks].add_(torch.matmul(probs.transpose(-1, -2), do_t).sum(2))
        d_scores = probs * (torch.matmul(do_t, v_t.transpose(-1, -2)) - delta[..., qs].unsqueeze(-1))
        if capped is not None:
            d_scores = d_scores * (1 - capped * capped)  # d/dx softcap * tanh(x / softcap)
        d_scores = d_scores * scale
        state["dq5"][..., qs, :].add_(torch.matmul(d_scores, k_t))
        dkv[0][:, :, ks].add_(torch.matmul(d_scores.transpose(-1, -2), q_t).sum(2))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least float32: the running max and log-sum-exp of low-precision scores lose the small terms.
    return torch.promote_types(dtype, torch.float32)


def _grouped(t: Tensor, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """``[b, q_heads, s, d]`` as ``[b, kv_heads, q_heads // kv_heads, s, d]``: query heads grouped by kv head.

    ``repeat_interleave(group, dim=1)`` of k/v (Hugging Face's ``repeat_kv``) pairs query
    head ``h`` with kv head ``h // group``; broadcasting k/v over the group axis does the
    same without materialising the repeated heads.
    """
    b, h, s, d = t.shape
    return t.to(dtype).reshape(b, kv_heads, h // kv_heads, s, d)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, mask, ring, scale, softcap):
        dtype = _compute_dtype(q.dtype)
        b, hq, s, d = q.shape
        q5 = _grouped(q, k.size(1), dtype)
        state = dict(q5=q5, positions=positions, mask=mask, scale=scale, softcap=softcap)
        state["out"] = torch.zeros(*q5.shape[:-1], v.size(-1), dtype=dtype, device=q.device)
        state["lse"] = torch.full(q5.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
        kv = [k, v]
        for step in range(ring.size):
            # Post the next block's transfer first so it travels while this block is computed.
            pending = ring.exchange(kv) if step < ring.size - 1 else None
            _forward_block(state, ring, (ring.rank - step) % ring.size, kv)
            if pending is not None:
                kv = pending.wait()
        out = state["out"].reshape(b, hq, s, v.size(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, state["lse"])
        ctx.mask, ctx.ring, ctx.scale, ctx.softcap = mask, ring, scale, softcap
        return out

    @staticmethod
    @once_differentiable  # the backward is hand-written math, not differentiable itself
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, dtype = ctx.ring, _compute_dtype(q.dtype)
        kv_heads = k.size(1)
        do5, q5 = _grouped(grad_out, kv_heads, dtype), _grouped(q, kv_heads, dtype)
        state = dict(q5=q5, do5=do5, lse=lse, mask=ctx.mask, scale=ctx.scale, softcap=ctx.softcap)
        state["positions"] = local_positions(ring.seq_len, ring.size, ring.rank, device=q.device)
        state["delta"] = (do5 * _grouped(out, kv_heads, dtype)).sum(-1)  # rowsum(dO * O)
        state["dq5"] = torch.zeros_like(q5)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=dtype, device=k.device), torch.zeros(v.shape, dtype=dtype, device=v.device)]
        for step in range(ring.size):
            pending = ring.exchange(kv) if step < ring.size - 1 else None
            _backward_block(state, ring, (ring.rank - step) % ring.size, kv, dkv)
            if pending is not None:
                kv = pending.wait()
            if ring.size > 1:
                # The accumulators follow their block around the ring; the last pass brings them home.
                dkv = ring.exchange(dkv).wait()
        dq = state["dq5"].reshape(q.shape).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise unless q, k, v are ``[batch, heads, seq, head_dim]`` with ``q_heads % kv_heads == 0``.

    Args:
        q: queries ``[batch, q_heads, s_local, head_dim]``.
        k: keys ``[batch, kv_heads, s_local, head_dim]``.
        v: values ``[batch, kv_heads, s_local, value_dim]``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [batch, heads, seq, head_dim] (Hugging Face / SDPA layout), got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must agree on batch and local sequence "
            f"length, k and v on heads, and q and k on head_dim."
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q_heads={q.shape[1]} is not a multiple of kv_heads={k.shape[1]}: grouped-query attention shares "
            f"each kv head among q_heads // kv_heads query heads."
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    mask: AttentionMask,
    group: Optional[dist.ProcessGroup],
    *,
    scale: float,
    softcap: Optional[float] = None,
) -> Tensor:
    """Exact attention of this rank's queries over the whole sequence, the keys and values passed around a ring.

    Each rank sends its key/value block to the next rank of ``group`` and receives the
    previous rank's, ``cp - 1`` times; every block is merged into the output with an online
    softmax (float32 log-sum-exp). A query that sees no key gets output 0 and gradient 0.

    Args:
        q: this rank's queries ``[batch, q_heads, s_local, head_dim]``, sharded with :func:`shard_sequence`.
        k: this rank's keys ``[batch, kv_heads, s_local, head_dim]`` (``q_heads % kv_heads == 0``).
        v: this rank's values ``[batch, kv_heads, s_local, value_dim]``.
        positions: ``local_positions(S, cp, cp_rank)``: the global positions of this rank's tokens.
        mask: which keys each query may see.
        group: the context-parallel process group (one rank: no communication).
        scale: the factor of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        softcap: Gemma-2 logit soft-capping, ``softcap * tanh(scores / softcap)``; None for none.

    Returns:
        ``[batch, q_heads, s_local, value_dim]`` in q's dtype, in this rank's local order.
    """
    check_attention_inputs(q, k, v)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = check_positions(positions, size, rank)
    mask.check_shape(q.size(0), seq_len)
    ring = _Ring(group=group, size=size, rank=rank, seq_len=seq_len)
    return _RingAttention.apply(q, k, v, positions, mask, ring, scale, softcap)
