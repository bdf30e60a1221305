"""A rejoining group's loader starts at the healthy groups' batch of the epoch, once."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel.fault_tolerance.data_position import skip_batches
from lightning_parallel.resumable_loader import resumable_loader


def _firsts(loader: DataLoader) -> list[int]:
    return [int(batch[0][0]) for batch in loader]


def test_a_plain_loader_skips_the_first_batches_of_the_next_pass_only() -> None:
    data = TensorDataset(torch.arange(40))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=False))
    whole = _firsts(loader)
    assert skip_batches(loader, 3) is None
    assert _firsts(loader) == whole[3:]
    assert _firsts(loader) == whole and len(loader) == len(whole)


def test_a_resumable_loader_uses_its_own_sampler_position() -> None:
    data = TensorDataset(torch.arange(40))
    loader = resumable_loader(data, 4, shuffle=False)
    whole = _firsts(loader)
    assert skip_batches(loader, 2) is None
    assert _firsts(loader) == whole[2:]


def test_a_loader_without_a_sampler_says_where_its_data_starts() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(8))

    notice = skip_batches(DataLoader(Stream(), batch_size=None), 2)
    assert notice is not None and "start of the epoch" in notice
