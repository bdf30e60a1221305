"""The data mesh ``parallelize`` takes for replicated data parallelism and HSDP, as the hybrid strategy builds it."""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel import _compat
from lightning_parallel.layout import DATA_AXES, DATA_PARALLEL, ParallelLayout
from lightning_parallel.parallel.data import data_mesh_shape


def data_mesh(layout: ParallelLayout, mesh: Any, zero_stage: int) -> Optional[Any]:
    """``mesh`` with its data axis unflattened into ``(data_replicate, data_shard)``, or None when not needed."""
    shape = data_mesh_shape(layout, zero_stage)
    return _compat.unflatten_mesh_dim(mesh, DATA_PARALLEL, shape, DATA_AXES) if shape is not None else None
