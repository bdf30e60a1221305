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

Checkpoints written at the very end of an epoch need
:class:`~lightning_parallel.callbacks.ExactDataResume` as well (Lightning 2.6 restores them
into the next epoch).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

# torchdata 0.11 calls torch.set_vital on every loader; torch 2.13 deprecated it. Nothing to act on.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


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
        A :class:`StatefulDataLoader` with a :class:`StatefulDistributedSampler`.
    """
    if "sampler" in loader_kwargs or "batch_sampler" in loader_kwargs:
        raise ValueError(
            "resumable_loader builds its own sampler: drop sampler=/batch_sampler= (use shuffle= and seed=)."
        )
    strategy = getattr(trainer, "strategy", None)
    shard = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    sampler = StatefulDistributedSampler(
        dataset,
        num_replicas=shard["num_replicas"],
        rank=shard["rank"],
        shuffle=shuffle,
        seed=int(os.environ.get("PL_GLOBAL_SEED", "0")) if seed is None else seed,
        drop_last=drop_last,
    )
    return StatefulDataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)
