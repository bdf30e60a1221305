"""Training data loaders whose position is part of every checkpoint, so a resume -- mid-epoch
included -- trains on exactly the samples an uninterrupted run would.

Lightning saves and restores the state of any ``train_dataloader`` that has
``state_dict``/``load_state_dict`` (torchdata's :class:`StatefulDataLoader`): batches served so far
and its sampler's state. That alone is not enough under a distributed strategy: Lightning then
wraps the loader's own sampler -- for ``shuffle=True`` torchdata's ``RandomSampler``, seeded from
the global RNG when the loader is built -- in a ``DistributedSamplerWrapper``, which keeps no
state, so a restarted job reshuffles the epoch differently (seen here: every batch after the
resume differed). :func:`resumable_loader` therefore shards and shuffles itself with
torchdata's ``StatefulDistributedSampler``: its order is a pure function of (seed, epoch,
data-parallel rank), Lightning sets the epoch and leaves an existing ``DistributedSampler``
alone, and the sampler's count of samples served is checkpointed. Lightning writes the
position of rank 0 only; it holds for every rank because all data-parallel ranks serve the same
number of equal batches (``drop_last``) from their own shard.

The position is saved as a place in the *global* sample stream, not as rank 0's count: rank ``r`` of
``R`` serves positions ``r, r + R, r + 2R, ...`` of the epoch's one permutation, so after ``k`` samples
per rank the ranks together have served exactly the first ``k * R`` positions, whatever ``R`` is. A run
resumed at another data-parallel size (data 2 x expert 2 -> data 4 x expert 4, TorchRec from 2 to 4
ranks, anything to one process) therefore starts every rank at ``k * R / R'`` and trains on the same
next global batches as the uninterrupted run; measured before: 1.7e-2 to 8.4e-2 off at data 4, because
rank 0's count of 16 was read as 16 samples of each of 4 ranks (a skip of 32 samples).

Checkpoints written at the very end of an epoch need
:class:`~lightning_parallel.callbacks.ExactDataResume` as well (Lightning 2.6 restores them
into the next epoch).
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Iterator
from typing import Any, Dict, Optional

from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

# torchdata 0.11 calls torch.set_vital on every loader; torch 2.13 deprecated it. Nothing to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class GlobalPositionSampler(StatefulDistributedSampler):
    """torchdata's ``StatefulDistributedSampler`` whose checkpointed position is global, so it reshards.

    Its state adds ``num_replicas`` (the data-parallel size that served ``yielded`` samples per rank); loaded at
    another size, the per-rank position becomes ``yielded * saved_replicas / num_replicas`` (the module docstring).
    Arguments as ``StatefulDistributedSampler``.

    Raises:
        ValueError: on load, when the global position does not fall on this size's sample boundary (the global
            batch changed so that no rank split continues exactly): the message says where it would resume.
    """

    _REPLICAS = "num_replicas"
    _SERVED = "yielded"  # the parent's key for samples served by this rank

    def state_dict(self) -> Dict[str, Any]:
        """``yielded`` (samples served by this rank in the epoch) and the ``num_replicas`` that served them."""
        return {**super().state_dict(), self._REPLICAS: self.num_replicas}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take a position saved at any data-parallel size (a state without ``num_replicas``: this size)."""
        saved = int(state_dict.get(self._REPLICAS, self.num_replicas))
        served = int(state_dict[self._SERVED]) * saved  # positions of the epoch's permutation served by all ranks
        if served % self.num_replicas:
            raise ValueError(
                f"The checkpoint's data position ({served} samples of this epoch, served by {saved} data-parallel "
                f"ranks) does not split over {self.num_replicas} ranks: resuming would repeat or skip samples. "
                f"Resume with a data-parallel size that divides {served}, or from a checkpoint at an epoch's end."
            )
        super().load_state_dict({**state_dict, self._SERVED: served // self.num_replicas})


def resumable_loader(
    dataset: Dataset,
    batch_size: int,
    trainer: Any | None = None,
    shuffle: bool = True,
    seed: int | None = None,
    drop_last: bool = True,
    **loader_kwargs: Any,
) -> StatefulDataLoader:
    """A training loader sharded over the data-parallel ranks whose position Lightning checkpoints.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per data-parallel rank per step.
        trainer: the Trainer (``self.trainer`` in a DataModule); its strategy's
            ``distributed_sampler_kwargs`` give this rank's data-parallel shard. ``None`` or a
            strategy without them (one device): the whole dataset.
        shuffle: a fresh permutation each epoch (Lightning calls ``set_epoch``).
        seed: seed of the permutation; default: the one ``seed_everything`` set
            (``PL_GLOBAL_SEED``), else 0 -- the seed Lightning's own injected sampler uses.
        drop_last: drop the uneven tail -- of the shard and of the last batch -- so every rank
            runs the same number of equal batches (pipeline micro-batching needs them).
        **loader_kwargs: passed to :class:`StatefulDataLoader` (``num_workers``, ``collate_fn``, ...).

    Returns:
        A :class:`StatefulDataLoader` with a :class:`GlobalPositionSampler`.
    """
    if "sampler" in loader_kwargs or "batch_sampler" in loader_kwargs:
        raise ValueError(
            "resumable_loader builds its own sampler: drop sampler=/batch_sampler= (use shuffle= and seed=)."
        )
    strategy = getattr(trainer, "strategy", None)
    shard = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    sampler = GlobalPositionSampler(
        dataset,
        num_replicas=shard["num_replicas"],
        rank=shard["rank"],
        shuffle=shuffle,
        seed=int(os.environ.get("PL_GLOBAL_SEED", "0")) if seed is None else seed,
        drop_last=drop_last,
    )
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)


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
        """Forwarded, so the skipped pass has the epoch's own shuffle."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def skip_samples(loader: Any, samples: int) -> Optional[str]:
    """Make ``loader``'s next pass start ``samples`` samples into this rank's shard; returns why it cannot.

    Must run before the pass draws its first index (a loader with workers draws some as its iterator is made).

    Args:
        loader: a training ``DataLoader`` (torch's, or torchdata's ``StatefulDataLoader``).
        samples: samples of this rank's shard to skip (``None`` is returned when done).
    """
    if samples <= 0:
        return None
    batch_sampler = getattr(loader, "batch_sampler", None)
    if getattr(loader, "batch_size", None) is None or batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        return ("the training loader has no sampler to position (an IterableDataset or a custom batch_sampler): it "
                f"reads from the start of the epoch, not from sample {samples} of this rank's shard. Give the "
                "dataset state_dict()/load_state_dict() (torchdata's StatefulDataLoader restores it) or resume from a "
                "checkpoint written at an epoch's end.")
    sampler = batch_sampler.sampler
    if isinstance(sampler, StatefulDistributedSampler):  # its own position, which its loader checkpoints
        sampler.load_state_dict({GlobalPositionSampler._SERVED: samples})
    else:
        batch_sampler.sampler = SkipFirstSamples(sampler, samples)
    return None
