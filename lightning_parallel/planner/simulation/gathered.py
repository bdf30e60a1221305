"""FSDP2's unsharded parameters at the peak of a step: what a rank gathers on top of what it stores.

FSDP2 all-gathers each unit (a layer, a bucket of layers, a stage's root) before its forward and backward. Under
ZeRO 3 a unit is freed after use and the next one is prefetched, so two units are whole at once; under ZeRO 2 (and
FSDP2's replicated ZeRO 0 beside other axes) every unit stays whole from its forward to its backward. The bytes are
the units' padded pieces times their shard count, in FSDP2's computing dtype (``param_dtype``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_parallel.planner.simulation.held import local


def unit_bytes(module: nn.Module, dtype_itemsize: Optional[int]) -> list[int]:
    """Unsharded bytes of each FSDP2 unit of ``module`` (its parameters not in a nested unit)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    sizes = []
    for unit in units:
        inner = {id(p) for child in unit.modules() if child is not unit and isinstance(child, FSDPModule)
                 for p in child.parameters()}
        total = 0
        for param in unit.parameters():
            if id(param) in inner or not hasattr(param, "device_mesh"):
                continue
            piece = local(param)
            itemsize = dtype_itemsize or piece.element_size()
            shards = _data_shards(param)
            total += piece.untyped_storage().nbytes() // piece.element_size() * shards * itemsize
        sizes.append(total)
    return sizes


def _data_shards(param: Any) -> int:
    from lightning_parallel.planner.simulation.shards import DATA_MESH_AXES

    mesh, count = param.device_mesh, 1
    for index, (axis, placement) in enumerate(zip(mesh.mesh_dim_names, param.placements)):
        if axis in DATA_MESH_AXES and (placement.is_shard() or "Strided" in type(placement).__name__):
            count *= mesh.size(index)
    return count


def gathered_bytes(module: nn.Module, zero_stage: int, policy: Any) -> int:
    """Bytes of unsharded parameters held at once at a step's peak (the module docstring).

    Args:
        module: the parallelised model.
        zero_stage: the run's ZeRO stage.
        policy: FSDP2's mixed-precision policy (None: the parameters' own dtype).
    """
    import torch

    dtype = getattr(policy, "param_dtype", None)
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    sizes = sorted(unit_bytes(module, itemsize), reverse=True)
    return sum(sizes[:2]) if zero_stage == 3 else sum(sizes)
