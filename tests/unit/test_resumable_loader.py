"""resumable_loader shards and shuffles like Lightning's injected sampler, reshuffles per epoch, and its
state resumes mid-epoch on the exact next batch."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_parallel.resumable_loader import resumable_loader

DATA = TensorDataset(torch.arange(40))


def _trainer(rank, ranks):
    return SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": ranks, "rank": rank}))


def _epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [batch[0].tolist() for batch in loader]


def test_ranks_partition_each_epoch_and_the_order_changes_between_epochs():
    loaders = [resumable_loader(DATA, 4, trainer=_trainer(rank, 2), seed=3) for rank in range(2)]
    epoch0 = [_epoch(loader, 0) for loader in loaders]
    served = sorted(i for batches in epoch0 for batch in batches for i in batch)
    assert served == list(range(40))  # every sample once across the two ranks
    assert [len(b) for b in epoch0] == [5, 5]
    assert _epoch(loaders[0], 1) != epoch0[0]
    # a pure function of the seed
    assert _epoch(resumable_loader(DATA, 4, trainer=_trainer(0, 2), seed=3), 0) == epoch0[0]


def test_without_a_trainer_the_whole_dataset_is_served_in_order_when_not_shuffled():
    assert _epoch(resumable_loader(DATA, 8, shuffle=False), 0) == [list(range(i, i + 8)) for i in range(0, 40, 8)]


def test_state_resumes_mid_epoch_on_the_next_batch():
    loader = resumable_loader(DATA, 4, trainer=_trainer(1, 2), seed=5)
    loader.sampler.set_epoch(2)
    iterator = iter(loader)
    first = [next(iterator)[0].tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [batch[0].tolist() for batch in iterator]

    resumed = resumable_loader(DATA, 4, trainer=_trainer(1, 2), seed=5)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)  # Lightning sets the epoch before the first batch is drawn
    assert [batch[0].tolist() for batch in resumed] == rest
    assert len(first) + len(rest) == 5


def test_a_sampler_argument_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="shuffle= and seed="):
        resumable_loader(DATA, 4, sampler=None)


def _served_after(loaders, epoch, batches):
    """Every rank's next batches after each served ``batches``, and their states."""
    states, rest = [], []
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        states.append(loader.state_dict())
        rest.append([batch[0].tolist() for batch in iterator])
    return states, rest


def _global_batches(per_rank):
    """The sets of samples the ranks train on together at each step (a global batch's order does not matter)."""
    return [sorted(i for rank in per_rank for i in rank[step]) for step in range(len(per_rank[0]))]


@pytest.mark.parametrize("ranks_before,ranks_after", [(2, 4), (4, 2), (2, 1), (1, 4)])
def test_a_position_saved_at_one_data_parallel_size_resumes_on_the_same_global_batches_at_another(
    ranks_before, ranks_after
):
    global_batch = 8
    before = [resumable_loader(DATA, global_batch // ranks_before, trainer=_trainer(r, ranks_before), seed=7)
              for r in range(ranks_before)]
    states, uninterrupted = _served_after(before, epoch=1, batches=2)

    after = [resumable_loader(DATA, global_batch // ranks_after, trainer=_trainer(r, ranks_after), seed=7)
             for r in range(ranks_after)]
    for loader in after:
        loader.load_state_dict(states[0])  # Lightning restores rank 0's state on every rank
    _, resumed = _served_after(after, epoch=1, batches=0)
    assert _global_batches(resumed) == _global_batches(uninterrupted)
    assert len(_global_batches(resumed)) == 40 // global_batch - 2


def test_negative_control_rank_zeros_count_read_as_each_ranks_count_skips_samples():
    # What the loader did before the position became global: 2 ranks' count of 8 each read at 4 ranks.
    before = [resumable_loader(DATA, 4, trainer=_trainer(r, 2), seed=7) for r in range(2)]
    states, uninterrupted = _served_after(before, epoch=1, batches=2)
    after = [resumable_loader(DATA, 2, trainer=_trainer(r, 4), seed=7) for r in range(4)]
    for loader in after:
        state = {**states[0]}
        sampler_state = {**state["_sampler_iter_state"]["sampler_state"]}
        sampler_state.pop("num_replicas")
        state["_sampler_iter_state"] = {**state["_sampler_iter_state"], "sampler_state": sampler_state}
        loader.load_state_dict(state)
    _, resumed = _served_after(after, epoch=1, batches=0)
    assert _global_batches(resumed) != _global_batches(uninterrupted)


def test_a_position_that_no_rank_split_continues_is_refused_with_the_fix():
    before = [resumable_loader(DATA, 3, trainer=_trainer(0, 1), seed=7)]
    states, _ = _served_after(before, epoch=0, batches=1)
    after = resumable_loader(DATA, 1, trainer=_trainer(0, 2), seed=7)
    after.load_state_dict(states[0])
    after.sampler.set_epoch(0)
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        next(iter(after))
