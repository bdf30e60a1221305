"""The expert-parallel module on a world of one: the full experts' math, their initial values, their split."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from examples.nlp.moe import GroupedExperts, MoEFeedForward
from lightning_parallel.parallel.experts import (
    ExpertParallel,
    combine,
    dispatch,
    expert_block,
    expert_parameters,
    reduce_expert_gradients,
)

D, H, E = 8, 16, 4


def test_expert_blocks_are_consecutive_and_a_bad_size_is_refused():
    assert [expert_block(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="pick ep among its divisors"):
        expert_block(6, 4, 0)


def test_block_with_expert_parallel_experts_equals_the_block(world_of_one):
    torch.manual_seed(0)
    block = MoEFeedForward(D, H, E, top_k=2, capacity_factor=1.0)
    reference = copy.deepcopy(block)
    block.experts = ExpertParallel(block.experts, dist.group.WORLD)
    x = torch.randn(12, D)
    out, out_ref = block(x), reference(x)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert (out - out_ref).abs().max() < 1e-6 and block.dropped_tokens == reference.dropped_tokens > 0
    for name in ("w_up", "w_down"):
        grad, grad_ref = getattr(block.experts, name).grad, getattr(reference.experts, name).grad
        assert (grad - grad_ref).abs().max() < 1e-6
    assert [n for n, _ in expert_parameters(block)] == ["experts.w_up", "experts.w_down"]
    reduce_expert_gradients(block, None, data_ranks=4)
    assert (block.experts.w_up.grad * 4 - reference.experts.w_up.grad).abs().max() < 1e-6


def test_reset_parameters_gives_the_full_modules_values(world_of_one):
    with torch.device("meta"):
        experts = GroupedExperts(E, D, H)
    sharded = ExpertParallel(experts, dist.group.WORLD)
    sharded.to_empty(device="cpu")
    torch.manual_seed(3)
    sharded.reset_parameters()
    torch.manual_seed(3)
    full = GroupedExperts(E, D, H)
    assert torch.equal(sharded.w_up, full.w_up) and torch.equal(sharded.w_down, full.w_down)


def test_token_level_dispatch_and_combine(world_of_one):
    torch.manual_seed(0)
    block = MoEFeedForward(D, H, E, top_k=2)
    x = torch.randn(10, D)
    ids, weights, _ = block.route(x)
    rows, counts, route = dispatch(x, ids, E, dist.group.WORLD)
    out = combine(block.experts(rows, counts), route, weights, dist.group.WORLD)
    assert (out - block(x)).abs().max() < 1e-6 and int(route.dropped) == 0
