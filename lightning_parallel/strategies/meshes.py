"""Every mesh and group a hybrid run needs, built once in ``setup_environment`` from the layout.

The root mesh ``(data[_context], pipeline, tensor)`` is the one torch creates groups for; every other mesh is a
view of it (same ranks, same root), so tensor-parallel DTensors, FSDP2's data mesh and the expert mesh compose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_parallel import _compat
from lightning_parallel.layout import (
    DATA_CONTEXT,
    DATA_PARALLEL,
    EXPERT_DATA,
    EXPERT_PARALLEL,
    ParallelLayout,
    expert_mesh,
    run_mesh,
)
from lightning_parallel.parallel.data import build_data_mesh
from lightning_parallel.parallel.token_axes import ExpertAxis


@dataclass(frozen=True)
class RunMeshes:
    """The meshes of one run.

    Attributes:
        layout: the layout they were built for.
        root: the root mesh ``layout.build_mesh`` made.
        run: what ``self.device_mesh`` is: the root, or its 4-D view under context parallelism.
        data: FSDP2's data mesh (``parallel.data.build_data_mesh``), or None where the run mesh's data axis serves.
        experts: the expert mesh and its groups (None without expert parallelism).
    """

    layout: ParallelLayout
    root: Any
    run: Any
    data: Any
    experts: Optional[ExpertAxis]

    @classmethod
    def build(cls, layout: ParallelLayout, device_type: str, zero_stage: int) -> RunMeshes:
        """Create them (collectives: every rank calls this once, after the process group exists).

        Args:
            layout: the resolved layout.
            device_type: ``"cpu"`` or ``"cuda"``.
            zero_stage: the run's ZeRO stage (the data mesh's shape).
        """
        root = layout.build_mesh(device_type)
        meshes = cls(layout, root, run_mesh(layout, root), build_data_mesh(layout, root, zero_stage), None)
        experts = expert_mesh(layout, root)
        if experts is None:
            return meshes
        # capacity is shared over data x context, as one process shares it over the whole batch
        axis = ExpertAxis(experts[EXPERT_PARALLEL], meshes.loss_group()[0], experts[EXPERT_DATA].get_group(),
                          _compat.grouped_mm)
        return cls(layout, root, meshes.run, meshes.data, axis)

    def loss_group(self) -> tuple[Optional[Any], int]:
        """``(group, size)`` of the ranks a loss is averaged over and gradients are reduced over: the data
        replicas, times the context ranks that each hold a share of every sequence; ``(None, 1)`` when alone."""
        layout = self.layout
        if layout.context_parallel_enabled:
            return self.root[DATA_CONTEXT].get_group(), layout.data_context
        if layout.data_parallel_enabled:
            return self.run[DATA_PARALLEL].get_group(), layout.data_parallel
        return None, 1
