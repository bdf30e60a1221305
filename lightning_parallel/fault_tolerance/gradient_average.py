"""``fault_tolerance.mode=ddp``: every step, the gradients of the groups taking part averaged through torchft's
manager (one all-reduce per gradient dtype), after the reductions inside each group."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.fault_tolerance.flat_buffers import flatten_by_dtype, pieces
from lightning_parallel.fault_tolerance.replica_state import local


def average_gradients(manager: Any, params: list[torch.Tensor], votes: tuple[float, ...] = ()) -> list[float]:
    """One torchft all-reduce (average over the groups taking part) per gradient dtype, in parameter order; returns
    ``votes`` averaged over the groups with the presence flags (no collective of their own).

    Every group flattens the same parameters in the same order; a parameter without a gradient sends zeros and a
    presence flag, so a gradient absent on one group but present on another (or on a group that sends zeros while
    it heals) is rebuilt, and one absent everywhere stays ``None`` as the optimizer expects.
    """
    grads = [local(p.grad) if p.grad is not None else None for p in params]
    filled = [g if g is not None else torch.zeros_like(local(p.data)) for p, g in zip(params, grads)]
    device = filled[0].device if filled else torch.device("cpu")
    flags = torch.tensor([0.0 if g is None else 1.0 for g in grads] + list(votes), device=device)
    present = flags[:len(grads)]
    buffers = flatten_by_dtype(filled)
    for work in [manager.allreduce(flags)] + [manager.allreduce(flat) for _, flat in buffers.values()]:
        work.wait()
    for idx, flat in buffers.values():
        for i, chunk in zip(idx, pieces(flat, [filled[i] for i in idx])):
            if present[i] == 0:
                params[i].grad = None
            elif grads[i] is not None:
                grads[i].copy_(chunk)
            else:
                params[i].grad = _grad_like(params[i], chunk)
    return [float(v) for v in flags[len(grads):]]


def _grad_like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(value.clone(), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value.clone()
