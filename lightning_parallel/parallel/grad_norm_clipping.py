"""Gradient clipping that sees the whole model, wherever its pieces live (the data axis reduces in FSDP2: data.py).

Note:
    ``torch.nn.utils.clip_grad_norm_`` sees one process's parameters. Under pipeline
    parallelism each rank holds different layers, so the norm to clip with is the
    combination of every stage's norm; under tensor parallelism some gradients are
    sharded DTensors (their norm is a partial sum over the tensor group) beside plain
    replicated ones (counted once), and torch refuses the mix. This module computes the
    true global norm across all three mesh axes and scales every gradient by the same
    coefficient, as Megatron-LM and torchtitan do by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.parallel.pipeline.tied import TIED_COPY_ATTR
from lightning_parallel.parallel.precision import upcast_for_reduction


def _grads_by_mesh(parameters: Iterable[Tensor]) -> dict[object, list[Tensor]]:
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            # Norms of DTensors on different meshes cannot be stacked: group by mesh.
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    return groups


def total_grad_norm(
    parameters: Union[Tensor, Iterable[Tensor]],
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
) -> Tensor:
    """The p-norm of all gradients of the model, the same value on every rank.

    Args:
        parameters: this rank's parameters (plain tensors and/or DTensors).
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        pipeline_group: the group of pipeline stages holding the rest of the model
            (None when the model is not pipelined). Data-parallel replicas need no
            reduction: their gradients are already averaged (or sharded as DTensors).

    The norm is computed and reduced in fp32 whatever the gradients' dtype (bf16 under
    ``bf16-true``): squares of bf16 gradients summed in bf16 lose the small ones.
    """
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    # A parameter tied across pipeline ranks (embedding and LM head) has a copy on each holder,
    # with the same summed gradient: count it once, as Megatron-LM skips ``param.shared``.
    params = [p for p in params if not getattr(p, TIED_COPY_ATTR, False)]
    norm_type = float(norm_type)
    norms = []
    for grads in _grads_by_mesh(params).values():
        grads = [upcast_for_reduction(g) for g in grads]
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=False if isinstance(grads[0], DTensor) else None)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    device = norms[0].device if norms else (params[0].device if params else torch.device("cpu"))
    local = (
        torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        if norms
        else torch.zeros((), device=device)
    )
    if pipeline_group is None or dist.get_world_size(pipeline_group) == 1:
        return local
    if norm_type == float("inf"):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pipeline_group)
        return local
    powered = local.pow(norm_type)
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=pipeline_group)
    return powered.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Union[Tensor, Iterable[Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    total: Optional[Tensor] = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the global norm across tensor and pipeline ranks.

    Args:
        parameters: parameters whose gradients are clipped in place.
        max_norm: largest allowed total norm.
        norm_type: p of the p-norm.
        error_if_nonfinite: raise if the total norm is nan or inf.
        pipeline_group: see :func:`total_grad_norm`.
        total: the norm of these gradients when the step already computed it (no collective then).

    Returns:
        The total norm before clipping (same on every rank).
    """
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    total = total_grad_norm(params, norm_type, pipeline_group) if total is None else total
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total gradient norm of order {norm_type} is non-finite ({total.item()}); cannot clip.")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in _grads_by_mesh(params).values():
        for g in grads:
            # Scale a DTensor through its local shard: the coefficient is the same plain
            # scalar on every rank, so no collective is needed.
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
    return total
