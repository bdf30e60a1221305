"""The one owner of a run's meshes and process groups, asked by axis name (torchtitan's ``ParallelDims``).

A run builds one :class:`RunMeshes` once its process group exists; everything after asks it for a mesh or a group by
the axis's name (``meshes.mesh(TENSOR_PARALLEL)``, ``meshes.group(EXPERT_DATA)``, ``meshes.loss_group()``), the
strategy and :func:`~lightning_parallel.parallel.compose.parallelize` alike. No other module creates a mesh.

The root mesh ``(data[_context], pipeline, tensor)`` is the one torch creates process groups for; every other mesh is
a view of it (same ranks, same root: ``_compat.unflatten_mesh_dim``), so tensor-parallel DTensors, FSDP2's data mesh
and the expert mesh compose:

- ``run``: what the user sees as ``self.device_mesh``: the root, or under context parallelism its 4-D view
  ``(data_parallel, context_parallel, pipeline_parallel, tensor_parallel)``;
- ``data``: FSDP2's data mesh, the data (x context) axis unflattened into ``(data_replicate, data_shard)`` where
  :func:`data_mesh_shape` asks for one (HSDP, or replicated ``zero_stage=0``), else None;
- ``experts``: the data (x context) axis unflattened into ``(expert_data, expert_parallel)``, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_parallel.layout import (
    CONTEXT_PARALLEL,
    DATA_AXES,
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

RUN_AXES = (DATA_PARALLEL, CONTEXT_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL)
AXES = (*RUN_AXES, DATA_CONTEXT, DATA_REPLICATE, DATA_SHARD, EXPERT_DATA, EXPERT_PARALLEL)


def data_mesh_shape(layout: ParallelLayout, zero_stage: int) -> Optional[tuple[int, int]]:
    """``(replicas, shards)`` of the 2-D data mesh FSDP2 needs, or None when the 1-D data axis serves.

    Under context parallelism the axis is data x context (context ranks hold the same parameters and
    each computes a share of every sequence's gradient): shards of a replica group span its context ranks.

    Args:
        layout: the resolved layout.
        zero_stage: 0 (replicated: ``(data x context, 1)`` when there is more than one such rank), 2 or 3
            (``(data_replicate, data_shard x context)`` under HSDP, else the flat axis).
    """
    if zero_stage == 0:
        return (layout.data_context, 1) if layout.data_context > 1 else None
    return (layout.data_replicate, layout.data_context // layout.data_replicate) if layout.hsdp_enabled else None


def _unflatten(root: Any, axis: str, shape: tuple[int, int], names: tuple[str, str]) -> Any:
    from lightning_parallel import _compat

    return _compat.unflatten_mesh_dim(root, axis, shape, names)


@dataclass(frozen=True)
class RunMeshes:
    """Every mesh of one run (the module docstring), asked by axis name.

    Attributes:
        layout: the layout they were built for.
        zero_stage: the ZeRO stage the data mesh was shaped for.
        root: the root mesh (the one with process groups of its own).
        run: ``self.device_mesh``: the root, or its 4-D view under context parallelism.
        data: FSDP2's 2-D data mesh, or None where the 1-D data (x context) axis serves.
        experts: the ``(expert_data, expert_parallel)`` mesh, or None without expert parallelism.
        rank: this process's global rank.
    """

    layout: ParallelLayout
    zero_stage: int
    root: Any
    run: Any
    data: Optional[Any]
    experts: Optional[Any]
    rank: int

    @classmethod
    def build(cls, layout: ParallelLayout, device_type: str, zero_stage: int = 0, timeout: Any = None) -> RunMeshes:
        """Create them (collectives: every rank calls this once, after the default process group exists).

        Args:
            layout: the resolved layout.
            device_type: ``"cpu"`` or ``"cuda"``.
            zero_stage: the run's ZeRO stage (the data mesh's shape).
            timeout: the groups' collective timeout (a ``timedelta``; the strategy's); None: torch's default, 30 min.
        """
        if timeout is None:
            return cls._build(layout, device_type, zero_stage)
        from lightning_parallel._compat.c10d_internals import default_group_timeout

        with default_group_timeout(timeout):  # init_device_mesh takes no timeout: without it a hang held 30 min
            return cls._build(layout, device_type, zero_stage)

    @classmethod
    def _build(cls, layout: ParallelLayout, device_type: str, zero_stage: int) -> RunMeshes:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        context = layout.context_parallel_enabled
        if context:
            root = init_device_mesh(device_type, (layout.data_context, layout.pipeline_parallel,
                                                  layout.tensor_parallel),
                                    mesh_dim_names=(DATA_CONTEXT, PIPELINE_PARALLEL, TENSOR_PARALLEL))
            run = _unflatten(root, DATA_CONTEXT, (layout.data_parallel, layout.context_parallel),
                             (DATA_PARALLEL, CONTEXT_PARALLEL))
        else:
            root = run = init_device_mesh(device_type, layout.shape,
                                          mesh_dim_names=(DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL))
        data_axis = DATA_CONTEXT if context else DATA_PARALLEL
        shape = data_mesh_shape(layout, zero_stage)
        # Under context parallelism the run's 4-D mesh has no flat data x context axis: FSDP2 takes the root's.
        data = _unflatten(root, data_axis, shape, DATA_AXES) if shape is not None else (root if context else None)
        experts = None
        if layout.expert_parallel > 1:
            experts = _unflatten(root, data_axis, (layout.data_context // layout.expert_parallel,
                                                   layout.expert_parallel), (EXPERT_DATA, EXPERT_PARALLEL))
        return cls(layout, zero_stage, root, run, data, experts, dist.get_rank())

    def mesh(self, axis: str) -> Any:
        """The 1-D mesh of ``axis`` (one of :data:`AXES`).

        Raises:
            ValueError: an unknown axis, or one this run's layout does not have (HSDP's or the experts' axes).
        """
        if axis in RUN_AXES and axis in (self.run.mesh_dim_names or ()):
            return self.run[axis]
        if axis == DATA_CONTEXT:
            return self.root[DATA_CONTEXT] if self.layout.context_parallel_enabled else self.run[DATA_PARALLEL]
        if axis in (EXPERT_DATA, EXPERT_PARALLEL) and self.experts is not None:
            return self.experts[axis]
        if axis in DATA_AXES and self.data is not None and axis in (self.data.mesh_dim_names or ()):
            return self.data[axis]
        if axis not in AXES:
            raise ValueError(f"Unknown mesh axis {axis!r}: ask for one of {AXES}.")
        raise ValueError(f"{self.layout.describe()} has no {axis!r} axis (zero_stage={self.zero_stage}).")

    def group(self, axis: str) -> Any:
        """The process group of ``axis`` (see :meth:`mesh`)."""
        return self.mesh(axis).get_group()

    def loss_group(self) -> tuple[Optional[Any], int]:
        """``(group, size)`` of the ranks a loss is averaged over and gradients are reduced over: the data
        replicas, times the context ranks that each hold a share of every sequence; ``(None, 1)`` when alone."""
        layout = self.layout
        if layout.context_parallel_enabled:
            return self.group(DATA_CONTEXT), layout.data_context
        if layout.data_parallel_enabled:
            return self.group(DATA_PARALLEL), layout.data_parallel
        return None, 1
