"""Write a DCP checkpoint folder atomically: shards into a hidden ``.<name>.partial`` folder, then Lightning's
metadata (``meta.pt``) and a rename make it visible; a crash between the two renames of a replacement leaves
``.<name>.old``, which :func:`resolve_checkpoint` falls back to. The folder's layout is
:mod:`lightning_parallel.checkpoints.dcp`'s; reading it back is :mod:`.reader`.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

METADATA_FILE = "meta.pt"


def partial_path(path: Path) -> Path:
    """The hidden folder (``.<name>.partial``) a checkpoint is written into before :func:`commit` renames it."""
    return path.with_name(f".{path.name}.partial")


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's warning that it saves or loads "in a single process": for converters, that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def drop_stale_partial(path: Path) -> None:
    """Remove the hidden partial folder of ``path`` that a crash during an earlier write left (coordinator only)."""
    partial = partial_path(path)
    if partial.exists():
        shutil.rmtree(partial)  # left by a crash during an earlier write


def write_shards(path: Path, state: dict[str, Any], no_dist: bool = False) -> Path:
    """Write the shards into the hidden ``.<name>.partial`` folder; returns it.

    Args:
        path: the final folder name; nothing is written there yet.
        state: the DCP state (``{"state_dict": ..., "optimizer_0": ...}``).
        no_dist: ``False``: every rank calls it (collective). ``True``: this one process
            writes everything, with no process group.
    """
    from torch.distributed.checkpoint import save

    partial = partial_path(path)
    save(state, checkpoint_id=partial, no_dist=no_dist)
    return partial


def _plain_values(value: Any) -> Any:
    """``value`` with every OmegaConf container inside turned into dicts and lists.

    Hydra hands a LightningModule its arguments as ``DictConfig``/``ListConfig``, which
    ``save_hyperparameters`` keeps; ``meta.pt`` is read back with ``weights_only=True``
    (:func:`~lightning_parallel.checkpoints.safe_loading.load_plain`), which refuses them, so a run
    could not resume from its own checkpoint. Other objects are left as they are.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        plain = copy.copy(value)  # a dict subclass stays what it was
        for key, item in value.items():
            plain[key] = _plain_values(item)
        return plain
    if type(value) in (list, tuple):
        return type(value)(_plain_values(item) for item in value)
    return value


def commit(path: Path, metadata: dict[str, Any]) -> None:
    """Coordinator only: add Lightning's metadata and make the checkpoint visible under ``path``.

    Until the rename, ``path`` still holds the previous complete checkpoint (or nothing), and the
    partial folder's hidden name matches no ``last*.ckpt`` pattern, so ``ckpt_path="last"`` can
    only ever pick a complete checkpoint. Replacing an existing folder takes two renames; a crash
    between them leaves ``.<name>.old``, which :func:`resolve_checkpoint` falls back to.

    Args:
        path: the final folder name; its ``.<name>.partial`` folder holds the shards.
        metadata: Lightning's checkpoint dict without the sharded state (saved as ``meta.pt``).
    """
    partial = partial_path(path)
    torch.save(_plain_values(metadata), partial / METADATA_FILE)
    old = _old_path(path)
    if old.exists():
        shutil.rmtree(old)
    if path.is_dir():
        path.rename(old)
    elif path.exists():
        path.unlink()
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def save_sharded_checkpoint(
    path: Path, state: dict[str, Any], metadata: dict[str, Any], is_coordinator: bool, barrier: Callable[[], None]
) -> None:
    """Write a checkpoint folder that becomes visible only once every rank has finished.

    Args:
        path: the final folder name (e.g. ``.../last.ckpt``).
        state: ``{"state_dict": ..., "optimizer_0": ...}`` of this rank (DCP-sharded).
        metadata: Lightning's remaining checkpoint dict (loops, callbacks, schedulers, ...).
        is_coordinator: True on exactly one rank (global rank 0).
        barrier: a barrier over all ranks.
    """
    if is_coordinator:
        drop_stale_partial(path)
    barrier()
    write_shards(path, state)
    barrier()
    if is_coordinator:
        commit(path, metadata)
    barrier()


def save_on_one_process(path: Path, state: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """Write a whole checkpoint folder from this one process (no process group), atomically as above.

    For converters: DCP saves with ``no_dist=True``, so it also works from a single rank of a
    running job without turning into a collective.

    Args:
        path: the folder to write; an existing one is replaced (see :func:`commit`).
        state: ``{"state_dict": ..., "optimizer_0": ...}`` with full tensors.
        metadata: Lightning's checkpoint dict (saved as ``meta.pt``).

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    drop_stale_partial(path)
    with single_process():
        write_shards(path, state, no_dist=True)
    commit(path, metadata)
    return path


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or the previous complete checkpoint if a crash interrupted replacing it.

    Args:
        path: the checkpoint folder asked for.
    """
    if not path.exists() and _old_path(path).is_dir():
        return _old_path(path)
    return path
