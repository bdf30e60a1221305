"""A DCP storage reader over full tensors already in memory (or memory-mapped from one file).

It lets a foreign checkpoint -- a single-file Lightning checkpoint read with
``torch.load(mmap=True)`` -- go through exactly the load path of the suite's own folders:
DCP plans, for this rank's layout (pipeline stage, DTensor shards, FSDP2 units), which slice
of each full tensor it needs, and :class:`InMemoryReader` copies only those slices. With a
memory-mapped source a rank therefore touches only the file pages of its own slices.

Note:
    Every tensor is presented as one chunk of its full shape, as if a single process had
    saved it; non-tensor values (learning rates, betas) go through the planner's
    ``load_bytes``, so :class:`~lightning_parallel.checkpoints.safe_loading.SafeLoadPlanner`
    still reads them with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future


def _tensor_metadata(tensor: torch.Tensor) -> TensorStorageMetadata:
    size = tensor.size()
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)
    return TensorStorageMetadata(properties=TensorProperties(dtype=tensor.dtype), size=size, chunks=[chunk])


class InMemoryReader(StorageReader):
    """Serve DCP reads from ``{dcp key: full tensor or plain value}``.

    Args:
        entries: flat keys as DCP names them (``"state_dict.blocks.0.up.weight"``,
            ``"optimizer_0.state.blocks.0.up.weight.exp_avg"``, ``"optimizer_0.param_groups.<name>.lr"``)
            mapped to full CPU tensors (memory-mapped ones are read lazily) or plain values.
    """

    def __init__(self, entries: Mapping[str, Any]) -> None:
        super().__init__()
        self.entries = dict(entries)

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Nothing to reset: the entries are fixed at construction."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """One full-size chunk per tensor, a bytes entry per plain value."""
        return Metadata(state_dict_metadata={
            key: _tensor_metadata(value) if torch.is_tensor(value) else BytesStorageMetadata()
            for key, value in self.entries.items()
        })

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """No storage to open."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy each requested slice of a full tensor into the planner's target (or hand it a plain value)."""
        for item in plan.items:
            value = self.entries[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(value, buffer)
                buffer.seek(0)
                planner.load_bytes(item, buffer)
                continue
            source = value
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, offset, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise ValueError(
                    f"Checkpoint entry {item.storage_index.fqn!r}: slice {tuple(source.size())} does not fit the "
                    f"target {tuple(target.size())}: the checkpoint does not match the model."
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Optional[Union[str, os.PathLike]]) -> bool:
        return True
