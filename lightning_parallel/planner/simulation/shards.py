"""Which part of each parameter a rank holds, from the parameter's placements and the rank's mesh coordinates.

A simulated rank's parameters are DTensors (or plain tensors) whose placements say how each mesh axis splits them;
the same placements hold on every rank of the layout, only the coordinates differ. So one simulated rank tells the
shapes -- and the region of every parameter -- that any other rank of its pipeline position holds, by the chunk
arithmetic DTensor and FSDP2 use (``torch.chunk``: pieces of ``ceil(n / k)`` rows, the last ones shorter or empty).
That is what lets :mod:`.classes` put ranks with equal shapes into one class without simulating them, and
:mod:`.whole_world` count how often every element is held across the whole world.

Note:
    Nesting order on one tensor dimension: a plain ``Shard`` splits in mesh order; FSDP2's ``_StridedShard`` (its
    shard of a dimension tensor parallelism split first) splits within the piece the others left, last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_parallel.layout import (
    CONTEXT_PARALLEL,
    DATA_CONTEXT,
    DATA_PARALLEL,
    DATA_REPLICATE,
    DATA_SHARD,
    EXPERT_DATA,
    EXPERT_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    ParallelLayout,
)
from lightning_parallel.layout.meshes import data_mesh_shape

# Mesh axes over which FSDP2 shards (its storage is padded to equal pieces there).
DATA_MESH_AXES = (DATA_PARALLEL, DATA_CONTEXT, DATA_SHARD, DATA_REPLICATE)


@dataclass(frozen=True)
class Split:
    """One mesh axis of a parameter's DTensor: its name, its size, the tensor dimension it splits (None: replicated),
    and whether it splits within what the other axes left (FSDP2's strided shard)."""

    axis: str
    size: int
    dim: Optional[int]
    strided: bool = False


@dataclass(frozen=True)
class ParamSpec:
    """A parameter as one simulated rank holds it.

    Attributes:
        name: its name in the unsplit model (the first name of tied parameters).
        shape: the global shape.
        itemsize: bytes per element.
        splits: the mesh axes of its DTensor (empty for a plain tensor).
        fsdp: whether FSDP2 shards it (its storage is padded to equal pieces).
        trainable: whether it gets a gradient and optimizer state.
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    splits: tuple[Split, ...] = ()
    fsdp: bool = False
    trainable: bool = True

    @property
    def pieces(self) -> int:
        """How many distinct pieces the splits cut it into (the product of the splitting axes' sizes)."""
        count = 1
        for split in self.splits:
            count *= split.size if split.dim is not None else 1
        return count

    def region(self, coordinates: dict[str, int]) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` per dimension of the piece a rank at ``coordinates`` (axis name -> index) holds."""
        extents = [[0, n] for n in self.shape]
        ordered = [s for s in self.splits if not s.strided] + [s for s in self.splits if s.strided]
        for split in ordered:
            if split.dim is None:
                continue
            start, length = extents[split.dim]
            offset, size = chunk(length, split.size, coordinates[split.axis])
            extents[split.dim] = [start + offset, size]
        return tuple((start, length) for start, length in extents)

    def local_shape(self, coordinates: dict[str, int]) -> tuple[int, ...]:
        """The local shape a rank at ``coordinates`` holds."""
        return tuple(length for _, length in self.region(coordinates))


def chunk(length: int, pieces: int, index: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``index`` when ``torch.chunk``-style splitting ``length`` rows into ``pieces``."""
    step = -(-length // pieces) if length else 0
    offset = min(index * step, length)
    return offset, max(0, min(step, length - offset))


def spec_of(name: str, param: Any) -> ParamSpec:
    """The :class:`ParamSpec` of one parameter of a simulated rank.

    Args:
        name: the parameter's name in the unsplit model.
        param: the parameter (a DTensor or a plain tensor, on ``meta``).
    """
    from torch.distributed.tensor import DTensor

    itemsize, trainable = param.element_size(), param.requires_grad
    if not isinstance(param, DTensor):
        return ParamSpec(name, tuple(param.shape), itemsize, (), False, trainable)
    mesh = param.device_mesh
    splits = []
    for index, (axis, placement) in enumerate(zip(mesh.mesh_dim_names, param.placements)):
        strided = "Strided" in type(placement).__name__  # FSDP2's shard of a dimension TP split first
        dim = placement.dim if placement.is_shard() or strided else None
        splits.append(Split(axis, mesh.size(index), dim, strided))
    fsdp = any(s.axis in DATA_MESH_AXES and s.dim is not None for s in splits)
    return ParamSpec(name, tuple(param.shape), itemsize, tuple(splits), fsdp, trainable)


def rank_coordinates(layout: ParallelLayout, zero_stage: int, rank: int) -> dict[str, int]:
    """``rank``'s index on every mesh axis :class:`~lightning_parallel.layout.meshes.RunMeshes` builds.

    Args:
        layout: the resolved layout.
        zero_stage: the ZeRO stage (the shape of FSDP2's data mesh).
        rank: a global rank.
    """
    data, pipeline, tensor = layout.coordinates(rank)
    context = layout.context_rank(rank)
    data_context = data * layout.context_parallel + context  # the root's flat data x context index
    shape = data_mesh_shape(layout, zero_stage)
    replica, shard = divmod(data_context, shape[1]) if shape is not None else (0, data_context)
    expert_data, expert = divmod(data_context, layout.expert_parallel)
    return {DATA_PARALLEL: data, CONTEXT_PARALLEL: context, PIPELINE_PARALLEL: pipeline, TENSOR_PARALLEL: tensor,
            DATA_CONTEXT: data_context, DATA_REPLICATE: replica, DATA_SHARD: shard, EXPERT_DATA: expert_data,
            EXPERT_PARALLEL: expert}
