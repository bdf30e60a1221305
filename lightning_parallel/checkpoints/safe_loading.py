"""Reading a DCP checkpoint without unpickling arbitrary objects.

torch 2.13's DCP unpickles ``.metadata`` and every non-tensor entry (learning rates, flags of
optimizer param groups) with plain ``pickle``/``torch.load(weights_only=False)``, which would
run any code planted in them. The reader and planner here replace exactly those two reads:
``.metadata`` goes through an allow-list of DCP's own classes, torch sizes/dtypes and plain
containers, and byte entries through ``torch.load(weights_only=True)``. Anything else is
refused with :class:`CheckpointRefused`.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from lightning_parallel._compat import dcp_metadata_path, dcp_set_element, load_planner_target


class CheckpointRefused(ValueError):
    """The checkpoint holds something other than tensors and plain values (tampered or foreign)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but only its own classes, torch sizes/dtypes and plain containers."""

    _TORCH_NAMES = {"Size", "device", "dtype", "layout", "memory_format", "strided", "sparse_coo", "contiguous_format",
                    "preserve_format", "channels_last", "channels_last_3d"}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (
                module == "torch"
                and (name in self._TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.serialization" and name == "_get_layout")
            or (
                module == "pathlib"
                and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
            )
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
        with self.fs.create_stream(dcp_metadata_path(self, rank), "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
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
        flatten, original_state_dict, state_dict, mappings = load_planner_target(self)
        if flatten:  # stored where DefaultLoadPlanner itself would store it
            dcp_set_element(original_state_dict, mappings[read_item.dest_index.fqn], loaded)
        else:
            state_dict[read_item.dest_index.fqn] = loaded


def load_plain(file: Any, weights_only: bool = True) -> Any:
    """``torch.load`` of a file that must hold only tensors and plain values (``meta.pt``).

    Args:
        file: the file to read.
        weights_only: passed to ``torch.load``; ``False`` only for files the caller trusts.

    Raises:
        CheckpointRefused: the file holds other objects (tampered or foreign).
    """
    try:
        return torch.load(file, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise CheckpointRefused(f"Refusing {file}: it holds more than tensors and plain values ({error}).") from None
