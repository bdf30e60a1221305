"""Start a rejoining replica group's training loader where the healthy groups are in the epoch.

Every replica group reads its own shard of the data and takes one batch per step in lockstep with the others,
so a group that comes back at batch ``b`` of epoch ``e`` resumes its shard at batch ``b`` of epoch ``e``: the
batches its previous incarnation did not commit are skipped (counted in the log), none is read twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Optional

from torch.utils.data import Sampler


class SkipFirstSamples(Sampler):
    """A sampler whose next pass starts ``count`` samples in; later passes are whole.

    Args:
        sampler: the loader's sampler (Lightning's ``DistributedSampler`` or the user's).
        count: samples to skip on the next pass.
    """

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.sampler), count, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded, so the shuffle of the epoch the group rejoins in is the healthy groups' shuffle."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def skip_batches(loader: Any, batches: int) -> Optional[str]:
    """Make ``loader``'s next pass start at batch ``batches``; returns why it cannot (``None`` when done).

    Args:
        loader: the training ``DataLoader`` (torch's or torchdata's ``StatefulDataLoader``).
        batches: batches of the current epoch already taken by the healthy replica groups.
    """
    if batches <= 0:
        return None
    batch_size = getattr(loader, "batch_size", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_size is None or batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        return (f"the training loader has no sampler to position (an IterableDataset or a custom batch_sampler): "
                f"this replica group reads its shard from the start of the epoch, not from batch {batches}.")
    sampler = batch_sampler.sampler
    if hasattr(sampler, "load_state_dict") and hasattr(sampler, "next_yielded"):
        # torchdata's StatefulDistributedSampler (resumable_loader): its own skip, which its loader checkpoints
        sampler.load_state_dict({"yielded": batches * batch_size})
    else:
        batch_sampler.sampler = SkipFirstSamples(sampler, batches * batch_size)
    return None
