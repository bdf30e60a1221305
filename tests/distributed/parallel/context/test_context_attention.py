"""Ring and Ulysses attention on 2 and 4 gloo ranks equal one process's attention over the whole sequence.

Every rank builds the same random q, k, v (one seed), computes the float64 reference over the
whole sequence with autograd, takes its head-tail share and runs the context-parallel attention;
the output and the q, k, v gradients of ``(out * w).sum()`` must equal the reference's, sharded
the same way. One launch per world size runs every case (starting ranks costs seconds).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.parallel.context import (
    AttentionMask,
    documents_from,
    gather_sequence,
    local_positions,
    ring_attention,
    shard_sequence,
    ulysses_attention,
)
from lightning_parallel.testing import run_processes

pytestmark = pytest.mark.slow

BATCH, SEQ, DIM, Q_HEADS = 2, 32, 8, 4
METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}


def _packed(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def _right_padded(lengths: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None]).long()


# Document boundaries and padding fall inside chunks (4 or 8 tokens); window 3 is under a chunk, 11 spans several.
CASES = {
    "causal": dict(causal=True),
    "causal_right_padding": dict(causal=True, attention_mask=_right_padded((27, 13))),
    "packed_documents": dict(causal=True, position_ids=_packed([[5, 9, 3, 15], [17, 10, 5]])),
    "window_3": dict(causal=True, window=3),
    "window_11": dict(causal=True, window=11),
    "bidirectional_padding": dict(causal=False, attention_mask=_right_padded((30, 9))),
    "gqa_4q_2kv": dict(causal=True, kv_heads=2),
    "gqa_documents_padding_softcap": dict(
        causal=True, kv_heads=2, softcap=3.0, attention_mask=_right_padded((32, 22)),
        position_ids=_packed([[6, 26], [11, 21]]),
    ),
}


def _reference(q, k, v, allowed, scale, softcap):
    """Float64 attention over the whole sequence from an explicit mask; a query that sees nothing gives 0."""
    repeat = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1) @ v) * allowed.any(-1, keepdim=True)


def _full_mask(causal, window, documents) -> torch.Tensor:
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None]
    allowed = (k <= q) if causal else torch.ones(SEQ, SEQ, dtype=torch.bool)
    if window is not None:
        allowed = allowed & ((q - k < window) if causal else ((q - k).abs() <= window))
    allowed = allowed[None, None].expand(BATCH, 1, SEQ, SEQ)
    if documents is not None:
        d = documents[:, None]
        allowed = allowed & (d[..., :, None] == d[..., None, :]) & (d[..., None, :] >= 0)
    return allowed


def _compare(method, group, case, drop_documents=False) -> dict[str, float]:
    """Max |difference| of this rank's output and q/k/v gradients from the sharded reference."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    causal, window, softcap = case.get("causal", True), case.get("window"), case.get("softcap")
    kv_heads = case.get("kv_heads", Q_HEADS)
    g = torch.Generator().manual_seed(1234)
    q, k, v, w = (torch.randn(BATCH, h, SEQ, DIM, generator=g, dtype=torch.float64)
                  for h in (Q_HEADS, kv_heads, kv_heads, Q_HEADS))
    documents = documents_from(case.get("attention_mask"), case.get("position_ids"))
    scale = DIM ** -0.5
    ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_inputs, _full_mask(causal, window, documents), scale, softcap)
    (ref * w).sum().backward()
    shard = lambda t: shard_sequence(t, 2, cp, rank)  # noqa: E731
    inputs = [shard(t).float().requires_grad_() for t in (q, k, v)]
    mask = AttentionMask(causal=causal, window=window, documents=None if drop_documents else documents)
    out = METHODS[method](*inputs, local_positions(SEQ, cp, rank), mask, group, scale=scale, softcap=softcap)
    saved = sum(t.numel() for t in out.grad_fn.saved_tensors) if method == "ring" else 0  # freed by backward
    (out * shard(w).float()).sum().backward()
    pairs = [("out", ref, out)] + [(f"d{n}", r.grad, t.grad) for n, r, t in zip("qkv", ref_inputs, inputs)]
    diffs = {name: float((shard(a.detach()) - b.detach().double()).abs().max()) for name, a, b in pairs}
    if method == "ring":
        # Saved for backward: q, k, v, out and the log-sum-exp of this rank's s_local tokens, nothing of size S.
        s_local = SEQ // cp
        diffs["saved_numel"] = saved
        diffs["saved_bound"] = BATCH * s_local * (3 * Q_HEADS * DIM + 2 * kv_heads * DIM + Q_HEADS)
    return diffs


def context_checks(rank: int, world_size: int) -> dict:
    """Every case with both methods on the world group; on 4 ranks also on two strided groups of 2."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    world = dist.group.WORLD
    result = {
        "parity": {(name, m): _compare(m, world, CASES[name]) for name in CASES for m in METHODS},
        "no_documents": {m: _compare(m, world, CASES["packed_documents"], drop_documents=True) for m in METHODS},
    }
    tensor = torch.randn(2, SEQ, 3, SEQ, generator=torch.Generator().manual_seed(7))
    shares = {dim: shard_sequence(tensor, dim, world_size, rank) for dim in (1, -1)}
    result["gather_round_trip"] = [torch.equal(gather_sequence(s, dim, world), tensor) for dim, s in shares.items()]
    if world_size == 4:
        # Ranks {0, 2} and {1, 3}: group ranks differ from global ranks, as on a mesh's context axis.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        result["subgroup"] = {
            (name, m): _compare(m, mine, CASES[name]) for name in ("packed_documents", "gqa_4q_2kv") for m in METHODS
        }
    return result


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def checks(request):
    return request.param, run_processes(context_checks, request.param, timeout=300)


def test_outputs_and_gradients_match_one_process(checks):
    cp, per_rank = checks
    for rank, result in enumerate(per_rank):
        runs = {**result["parity"], **{("subgroup",) + key: d for key, d in result.get("subgroup", {}).items()}}
        for key, diffs in runs.items():
            for name in ("out", "dq", "dk", "dv"):
                assert diffs[name] < 1e-5, f"cp={cp} rank {rank} {key} {name}: {diffs[name]:.2e}"


def test_ring_saves_only_this_ranks_share(checks):
    _, per_rank = checks
    for result in per_rank:
        for (_, method), diffs in result["parity"].items():
            if method == "ring":
                assert 0 < diffs["saved_numel"] <= diffs["saved_bound"]


def test_parity_check_detects_a_dropped_document_mask(checks):
    # Negative control: without the documents, tokens attend across packed documents.
    cp, per_rank = checks
    for rank, result in enumerate(per_rank):
        for method, diffs in result["no_documents"].items():
            assert diffs["out"] > 1e-3, f"cp={cp} rank {rank} {method}"


def test_gather_undoes_shard_on_every_rank(checks):
    _, per_rank = checks
    assert all(all(result["gather_round_trip"]) for result in per_rank)
