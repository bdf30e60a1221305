"""Capacity split over ranks: each rank's kept copies are what one process keeps on the concatenated batch."""

from __future__ import annotations

import torch

from lightning_parallel.parallel.experts import kept_copies, kept_of_rank


def _one_process_keep(expert_ids: torch.Tensor, capacity: int, num_experts: int) -> torch.Tensor:
    """Per copy, whether one process keeps it: a counter per expert over the copies in token order."""
    taken, keep = [0] * num_experts, []
    for e in expert_ids.tolist():
        taken[e] += 1
        keep.append(taken[e] <= capacity)
    return torch.tensor(keep)


def test_ranks_keep_what_one_process_keeps_on_the_concatenated_batch():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        ranks, experts, top_k, tokens = 4, 8, 2, 12
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(ranks * tokens)])
        capacity = 1 + trial % 5
        one = _one_process_keep(ids.flatten(), capacity, experts).view(ranks, -1)
        per_rank = ids.view(ranks, -1)
        counts = torch.stack([torch.bincount(r, minlength=experts) for r in per_rank])
        for rank in range(ranks):
            kept = kept_of_rank(counts, capacity, rank)
            copies = kept_copies(per_rank[rank], counts[rank], kept)
            assert sorted(copies.tolist()) == one[rank].nonzero().flatten().tolist()
        dropped = sum(int((counts[r] - kept_of_rank(counts, capacity, r)).sum()) for r in range(ranks))
        assert dropped == int((~one).sum())


def test_kept_copies_sorts_by_expert_then_token_and_keeps_the_first():
    ids = torch.tensor([2, 0, 2, 1, 0, 2])  # copies of tokens 0..2 with top_k=2
    counts = torch.bincount(ids, minlength=3)
    assert kept_copies(ids, counts, counts).tolist() == [1, 4, 3, 0, 2, 5]
    assert kept_copies(ids, counts, torch.tensor([1, 1, 2])).tolist() == [1, 3, 0, 2]
