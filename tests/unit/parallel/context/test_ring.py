"""Ring and Ulysses attention in a context group of one rank against a float64 reference."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.parallel.context import (
    AttentionMask,
    check_heads,
    context_attention,
    documents_from,
    local_positions,
    ring_attention,
    ulysses_attention,
)
from lightning_parallel.parallel.context.ring import _Ring, _tiles

BATCH, SEQ, DIM = 2, 16, 8


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("ring") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def reference_attention(q, k, v, allowed, scale, softcap=None):
    """Plain float64 attention; a query that sees no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    group_size = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group_size, 1), v.repeat_interleave(group_size, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is None:
        return scores.softmax(-1) @ v
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1) @ v) * allowed.any(-1, keepdim=True)


def full_mask(causal, window, documents):
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool)
    if causal:
        allowed &= k <= q
    if window is not None:
        allowed &= (q - k < window) if causal else ((q - k).abs() <= window)
    allowed = allowed[None, None]
    if documents is not None:
        d = documents[:, None]
        allowed = allowed & (d[..., :, None] == d[..., None, :]) & (d[..., None, :] >= 0)
    return None if not causal and window is None and documents is None else allowed


PADDING = torch.tensor([[1] * 11 + [0] * 5, [1] * 16])
PACKED = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5], list(range(9)) + list(range(7))])
CASES = {
    "causal": dict(causal=True),
    "causal_padding": dict(causal=True, attention_mask=PADDING),
    "documents": dict(causal=True, position_ids=PACKED),
    "window_3": dict(causal=True, window=3),
    "window_11_padding": dict(causal=True, window=11, attention_mask=PADDING),
    "bidirectional": dict(causal=False),
    "bidirectional_padding_window": dict(causal=False, window=2, attention_mask=PADDING),
    "gqa_documents": dict(causal=True, position_ids=PACKED, kv_heads=2),
    "gqa_softcap": dict(causal=True, kv_heads=1, softcap=2.0),
}


def run_case(fn, group, dtype, causal, window=None, attention_mask=None, position_ids=None, kv_heads=4,
             softcap=None):
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(BATCH, h, SEQ, DIM, generator=g, dtype=torch.float64) for h in (4, kv_heads, kv_heads, 4))
    documents = documents_from(attention_mask, position_ids)
    scale = DIM ** -0.5
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_inputs, full_mask(causal, window, documents), scale, softcap)
    (ref * w).sum().backward()
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    mask = AttentionMask(causal=causal, window=window, documents=documents)
    out = fn(*inputs, local_positions(SEQ, 1, 0), mask, group, scale=scale, softcap=softcap)
    (out * w.to(dtype)).sum().backward()
    assert out.dtype == dtype
    return {name: float((a.detach() - b.detach().double()).abs().max()) for name, a, b in [
        ("out", ref, out), *((f"d{n}", r.grad, t.grad) for n, r, t in zip("qkv", ref_inputs, inputs))
    ]}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention], ids=["ring", "ulysses"])
def test_one_rank_matches_float64_reference(group, fn, name):
    diffs = run_case(fn, group, torch.float32, **CASES[name])
    assert max(diffs.values()) < 1e-5, diffs
    diffs64 = run_case(fn, group, torch.float64, **CASES[name])
    assert max(diffs64.values()) < 1e-12, diffs64


def test_a_query_that_sees_no_key_gets_zero_output_and_zero_gradient(group):
    q, k, v = (torch.randn(1, 2, SEQ, DIM, requires_grad=True) for _ in range(3))
    documents = torch.full((1, SEQ), -1)
    documents[0, :4] = 0
    out = ring_attention(q, k, v, local_positions(SEQ, 1, 0), AttentionMask(documents=documents), group, scale=0.3)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert out[:, :, 4:].abs().max() == 0 and q.grad[:, :, 4:].abs().max() == 0
    assert k.grad[:, :, 4:].abs().max() == 0 and v.grad[:, :, 4:].abs().max() == 0


def test_ring_saves_only_linear_activations(group):
    # 64 tokens, head dim 8: per-block scores would be 64 x 64 per head, 8x the linear bound.
    seq, heads, dim = 64, 4, 8
    q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, local_positions(seq, 1, 0), AttentionMask(), group, scale=0.3)
    saved = out.grad_fn.saved_tensors
    # q, k, v, out (each heads * seq * dim) and the float32 log-sum-exp (heads * seq).
    assert sum(t.numel() for t in saved) == 4 * heads * seq * dim + heads * seq
    assert sum(t.numel() for t in saved) <= 5 * heads * seq * dim
    assert all(seq * seq > t.numel() // heads for t in saved)


def test_causal_head_tail_skips_half_the_tiles():
    for cp in (2, 4):
        for rank in range(cp):
            ring = _Ring(group=None, size=cp, rank=rank, seq_len=8 * cp)
            tiles = [_tiles(ring, AttentionMask(), source) for source in range(cp)]
            computed = sum((qs.stop - qs.start) * (ks.stop - ks.start) for block in tiles for qs, ks in block)
            assert computed == (2 * cp + 1) * 4 * 4  # of (2 cp)^2 chunk tiles of 4 x 4 tokens


def test_heads_that_do_not_split_point_to_ring():
    check_heads(8, 2, 4)
    check_heads(8, 8, 2, tensor_size=2)
    with pytest.raises(ValueError, match="context_parallel_method='ring'"):
        check_heads(6, 2, 4)
    with pytest.raises(ValueError, match="per tensor rank"):
        check_heads(8, 8, 4, tensor_size=4)


def test_dispatcher_and_its_refusals(group):
    q = torch.randn(1, 2, SEQ, DIM)
    args = (q, q, q, local_positions(SEQ, 1, 0), AttentionMask(), group)
    ring = context_attention("ring", *args, scale=0.5)
    assert torch.allclose(context_attention("ulysses", *args, scale=0.5), ring, atol=1e-6)
    with pytest.raises(ValueError, match="'ring' or 'ulysses'"):
        context_attention("ringg", *args, scale=0.5)
    with pytest.raises(ValueError, match="softcap"):
        ulysses_attention(*args, scale=0.5, softcap=1.0, local_attention=lambda *a: a[0])
    with pytest.raises(ValueError, match="local_positions"):
        ring_attention(q, q, q, torch.arange(SEQ).flip(0), AttentionMask(), group, scale=0.5)
    kv = torch.randn(1, 3, SEQ, DIM)
    with pytest.raises(ValueError, match="not a multiple of kv_heads=3"):
        ring_attention(q, kv, kv, local_positions(SEQ, 1, 0), AttentionMask(), group, scale=0.5)


def test_ulysses_hands_the_kernel_the_global_mask(group):
    seen = {}

    def kernel(q, k, v, allowed, scale):
        seen["allowed"] = allowed
        return q * scale

    q = torch.randn(1, 2, SEQ, DIM)
    mask = AttentionMask(window=3)
    out = ulysses_attention(q, q, q, local_positions(SEQ, 1, 0), mask, group, scale=0.5, local_attention=kernel)
    assert torch.equal(out, q * 0.5)
    assert torch.equal(seen["allowed"], mask.block(torch.arange(SEQ), torch.arange(SEQ)))


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention], ids=["ring", "ulysses"])
def test_bfloat16_inputs_give_bfloat16_close_to_the_reference(group, fn):
    diffs = run_case(fn, group, torch.bfloat16, causal=True, position_ids=PACKED, kv_heads=2)
    assert max(diffs.values()) < 5e-2, diffs
