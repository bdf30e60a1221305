"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), for any mix of pipeline stages,
DTensor shards and plain replicated tensors.

A checkpoint is a folder: DCP shards of ``{"state_dict": ..., "optimizer_0": ...}`` with every
tensor under its unsplit name and full shape (pipeline stages keep their original layer
names; DTensors are stored whole), plus ``meta.pt`` with Lightning's own state (loops,
callbacks, schedulers). DCP plans the writes so each rank writes its own tensors once, and
reshards on load: a rank reads exactly the slices its current layout holds.

Note:
    Lightning's ``ModelParallelStrategy`` writes this same layout but its loader insists on
    a model holding DTensors; a pipeline-only or replicated model holds none, so loading is
    done here with DCP directly. Optimizer state is *flattened* (one key per parameter and
    setting, as torchtitan does): the nested form stores ``param_groups`` as one object per
    checkpoint, which DCP de-duplicates across ranks -- pipeline stages, whose groups list
    different parameters, would then load another stage's groups.
"""

from __future__ import annotations

import io
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.optim import Optimizer

METADATA_FILE = "meta.pt"


class CheckpointRefused(ValueError):
    """The checkpoint holds something other than tensors and plain values (tampered or foreign)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but only its own classes, torch sizes/dtypes and plain containers."""

    _TORCH_NAMES = {"Size", "device", "dtype", "layout", "memory_format", "strided", "sparse_coo", "contiguous_format",
                    "preserve_format", "channels_last", "channels_last_3d"}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name in self._TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"})
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice", "tuple", "list", "dict"})
        )
        if not allowed:
            raise CheckpointRefused(
                f"Refusing to load a checkpoint whose metadata references {module}.{name}: a checkpoint holds only "
                "tensors and plain values. The file was tampered with or written by something else."
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with the metadata unpickled through an allow-list.

    Note:
        torch 2.13's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``,
        which would run any code planted in it; tensors themselves are read with
        ``weights_only=True``.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``weights_only=True``.

    Note:
        The default planner loads byte entries (learning rates, flags of optimizer param
        groups) with ``torch.load(weights_only=False)``.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointRefused(f"Refusing checkpoint entry {read_item.dest_index.fqn!r}: {error}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def write_shards(path: Path, state: dict[str, Any]) -> Path:
    """Every rank writes its shards into the hidden ``.<name>.partial`` folder (collective); returns it."""
    from torch.distributed.checkpoint import save

    partial = _partial_path(path)
    save(state, checkpoint_id=partial)
    return partial


def commit(path: Path, metadata: dict[str, Any]) -> None:
    """Coordinator only: add Lightning's metadata and make the checkpoint visible under ``path``.

    Until the rename, ``path`` still holds the previous complete checkpoint (or nothing), and the
    partial folder's hidden name matches no ``last*.ckpt`` pattern, so ``ckpt_path="last"`` can
    only ever pick a complete checkpoint. Replacing an existing folder takes two renames; a crash
    between them leaves ``.<name>.old``, which :func:`resolve_checkpoint` falls back to.
    """
    partial = _partial_path(path)
    torch.save(metadata, partial / METADATA_FILE)
    old = _old_path(path)
    if old.exists():
        shutil.rmtree(old)
    if path.is_dir():
        path.rename(old)
    elif path.exists():
        path.unlink()
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def save_sharded_checkpoint(path: Path, state: dict[str, Any], metadata: dict[str, Any], is_coordinator: bool, barrier: Callable[[], None]) -> None:
    """Write a checkpoint folder that becomes visible only once every rank has finished.

    Args:
        path: the final folder name (e.g. ``.../last.ckpt``).
        state: ``{"state_dict": ..., "optimizer_0": ...}`` of this rank (DCP-sharded).
        metadata: Lightning's remaining checkpoint dict (loops, callbacks, schedulers, ...).
        is_coordinator: True on exactly one rank (global rank 0).
        barrier: a barrier over all ranks.
    """
    partial = _partial_path(path)
    if is_coordinator and partial.exists():
        shutil.rmtree(partial)  # left by a crash during an earlier write
    barrier()
    write_shards(path, state)
    barrier()
    if is_coordinator:
        commit(path, metadata)
    barrier()


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or the previous complete checkpoint if a crash interrupted replacing it."""
    if not path.exists() and _old_path(path).is_dir():
        return _old_path(path)
    return path


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state under full parameter names, flattened for DCP (see the note above)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def is_sharded_checkpoint(path: Path) -> bool:
    """A DCP checkpoint folder written by the suite (or Lightning's ModelParallelStrategy)."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load this rank's share of the model and optimizer state; return Lightning's metadata.

    Every rank of the job must call it (DCP loads collectively).

    Args:
        path: the checkpoint folder.
        module: the parallelised model (pipeline stage, DTensor shards, FSDP2 units).
        optimizers: its optimizers, in Lightning's order (``optimizer_0``, ``optimizer_1``, ...).
        strict: every key of the module must be in the checkpoint.
        weights_only: passed to ``torch.load`` for ``meta.pt``.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    def load(state: dict, checkpoint_id: Path) -> None:
        dcp_load(state, storage_reader=SafeFileSystemReader(checkpoint_id), planner=SafeLoadPlanner())

    model_state = {"state_dict": get_model_state_dict(module)}
    load(model_state, checkpoint_id=path)
    set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optim_state = {key: optimizer_state_dict(module, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=flat)
    try:
        return torch.load(path / METADATA_FILE, weights_only=True if weights_only is None else weights_only)
    except pickle.UnpicklingError as error:
        raise CheckpointRefused(f"Refusing {path / METADATA_FILE}: it holds more than tensors and plain values ({error}).") from None
