"""Start a rejoining replica group's training loader where the healthy groups are in the epoch.

Every replica group reads its own shard of the data and takes one batch per step in lockstep with the others,
so a group that comes back at batch ``b`` of epoch ``e`` resumes its shard at batch ``b`` of epoch ``e``: the
batches its previous incarnation did not commit are skipped (counted in the log), none is read twice.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.resumable_loader import skip_samples


def skip_batches(loader: Any, batches: int) -> Optional[str]:
    """Make ``loader``'s next pass start at batch ``batches``; returns why it cannot (``None`` when done).

    Args:
        loader: the training ``DataLoader`` (torch's or torchdata's ``StatefulDataLoader``).
        batches: batches of the current epoch already taken by the healthy replica groups.
    """
    batch_size = getattr(loader, "batch_size", None) or 1  # a loader without one is refused by skip_samples
    return skip_samples(loader, batches * batch_size)
