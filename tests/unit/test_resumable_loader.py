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
