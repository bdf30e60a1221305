"""The sampler trap at resume: a notice when Lightning's shuffling sampler changes the data order of a resumed run.

Lightning's ``use_distributed_sampler=True`` (the default) wraps every training loader of a multi-process run in a
*shuffling* ``DistributedSampler`` -- even a loader built with ``shuffle=False``, and even when the data-parallel
size is 1 and the sampler shards nothing (Lightning 2.6's data connector
passes ``shuffle=True`` for every training loader). A run resumed under the suite from a checkpoint another
strategy wrote (one process, DDP, DeepSpeed, or the suite at another layout) therefore sees other batches than the
run that wrote it would have: measured 0.063 off the uninterrupted losses for a Lightning single-device checkpoint
resumed under tensor 2. Nothing fails; the notice says so once, with the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from torch.utils.data import DistributedSampler, SequentialSampler

from lightning_parallel import _compat
from lightning_parallel.callbacks.exact_resume import ExactDataResume
from lightning_parallel.checkpoints import resolve_checkpoint
from lightning_parallel.checkpoints.dcp import METADATA_FILE
from lightning_parallel.checkpoints.detect import describe_checkpoint
from lightning_parallel.checkpoints.safe_loading import load_plain


def _same_layout_writer(path: Path, shape: tuple[int, ...]) -> bool:
    """Whether ``path`` is a suite checkpoint written at the mesh shape ``shape`` (the same sampler shards)."""
    try:
        meta = load_plain(path / METADATA_FILE)
    except Exception:  # noqa: BLE001 -- an unreadable meta.pt is load_checkpoint's error to raise, not this notice's
        return False
    recorded = (meta.get("lightning_parallel") or {}).get("layout")
    return recorded is not None and tuple(recorded) == tuple(shape)


def resumed_shuffle_notice(trainer: Any, dataloader: Any, shape: tuple[int, ...]) -> Optional[str]:
    """The notice for ``dataloader`` when the fit resumes a checkpoint written under another strategy or layout
    and carries Lightning's shuffling ``DistributedSampler``; ``None`` otherwise.

    Args:
        trainer: the running ``Trainer`` (its ``ckpt_path`` and the fit's training loader).
        dataloader: the loader Lightning prepared, as ``Strategy.process_dataloader`` receives it.
        shape: this strategy's mesh shape ``(data, pipeline, tensor)``.
    """
    sampler = getattr(dataloader, "sampler", None)
    ckpt_path = getattr(trainer, "ckpt_path", None)
    if ckpt_path is None or type(sampler) is not DistributedSampler or not sampler.shuffle:
        return None
    # The loader as the user wrote it (re-made by its hook, only on this resume path): a sampler of the user's own
    # (a DistributedSampler, or a shuffling one) means the order was theirs to choose; a sequential one, that
    # Lightning injected the shuffle.
    original = getattr(_compat.fit_loop_train_dataloader(trainer), "sampler", None)
    if not isinstance(original, SequentialSampler):
        return None
    path = resolve_checkpoint(Path(ckpt_path))
    writer, description = describe_checkpoint(path)
    # The suite's strategies all put the same (seed, epoch) permutation on the loader, so a suite checkpoint of any
    # layout continues on its batches once ExactDataResume places the sampler at the global position it saved.
    placed = any(isinstance(c, ExactDataResume) for c in getattr(trainer, "callbacks", []))
    if writer == "suite-dcp" and (placed or _same_layout_writer(path, shape)):
        return None
    data = shape[0]
    sharding = "shards nothing at data-parallel size 1 and only" if data == 1 else "shards and"
    return (f"lightning_parallel: resuming {str(ckpt_path)!r} ({description}) with the shuffling DistributedSampler "
            f"Lightning put on the training loader (use_distributed_sampler=True does so even for shuffle=False); "
            f"it {sharding} reorders the data, so the batches after resume differ from the ones the writing run "
            "would have seen. For the same order: Trainer(use_distributed_sampler=False) with a loader sharded by "
            "strategy.distributed_sampler_kwargs (lightning_parallel.resumable_loader.resumable_loader does this).")
