"""Head-tail sharding: which positions each context rank holds, and that sharding is undone by reassembly."""

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.parallel.context import (
    check_positions,
    check_sequence,
    gather_sequence,
    local_positions,
    shard_sequence,
)


def test_head_tail_positions_of_two_and_four_ranks():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [local_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9],
    ]
    assert local_positions(6, 1, 0).tolist() == list(range(6))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_positions_cover_the_sequence_once_and_balance_causal_work(cp):
    seq = 8 * cp
    shares = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shares).tolist()) == list(range(seq))
    # Causal work of a rank = number of visible (query, key) pairs = sum of (position + 1).
    assert len({int((share + 1).sum()) for share in shares}) == 1


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shards_put_back_by_their_positions_give_the_tensor(cp, dim):
    tensor = torch.randn(8 * cp, 8 * cp, 8 * cp)
    shards = [shard_sequence(tensor, dim, cp, r) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert shard.is_contiguous()
        index = local_positions(tensor.size(dim), cp, r)
        assert torch.equal(shard, tensor.index_select(dim, index))
    rebuilt = torch.empty_like(tensor)
    rebuilt.index_copy_(dim, torch.cat([local_positions(tensor.size(dim), cp, r) for r in range(cp)]),
                        torch.cat(shards, dim))
    assert torch.equal(rebuilt, tensor)


def test_a_shard_is_a_copy():
    tensor = torch.zeros(2, 8)
    shard_sequence(tensor, 1, 1, 0).fill_(1)
    assert tensor.sum() == 0


def test_gather_in_a_group_of_one_is_the_identity(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        tensor = torch.randn(2, 12, 3)
        gathered = gather_sequence(shard_sequence(tensor, 1, 1, 0), 1, dist.group.WORLD)
        assert torch.equal(gathered, tensor)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seq_len, cp", [(12, 4), (7, 1), (4, 4)])
def test_a_sequence_that_does_not_split_names_the_setting_and_the_lengths_that_work(seq_len, cp):
    with pytest.raises(ValueError, match=rf"context_parallel_size={cp}.*multiples of {2 * cp}"):
        check_sequence(seq_len, cp)
    with pytest.raises(ValueError, match="cp="):
        check_sequence(seq_len, cp, setting="cp")


def test_wrong_rank_or_positions_are_refused():
    with pytest.raises(ValueError, match=r"cp_rank=2 must be in \[0, 2\)"):
        local_positions(8, 2, 2)
    assert check_positions(local_positions(16, 2, 1), 2, 1) == 16
    with pytest.raises(ValueError, match=r"local_positions\(16, 2, 1\)"):
        check_positions(torch.arange(8), 2, 1)
