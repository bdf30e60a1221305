"""Bytes a rank holds as stored: parameters, gradients and optimizer state, after its first optimizer step.

"As stored" is what a rank's allocator holds, not the sum of local shapes:

- parameters: FSDP2 keeps each sharded parameter in a storage padded to ``ceil(rows / shards)`` rows on every rank
  (the last ranks hold shorter or empty local shards inside it); everything else holds its local shape;
- gradients: FSDP2's reduce-scatter writes each layer's gradients into one padded buffer and the gradients are views
  of it (the parameters' padded bytes, where the reduction dtype is the parameters'); torch's DDP (the data axis of
  ``zero_stage=0`` alone) keeps them as views of its buckets, which hold exactly the parameters; otherwise the local
  shape;
- optimizer: the state ``configure_optimizers``'s optimizer really creates, measured after one step on ``meta``
  (AdamW: ``exp_avg`` and ``exp_avg_sq`` shaped like the local parameter, and a 4-byte ``step`` on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.planner.simulation.shards import ParamSpec


def local(tensor: Tensor) -> Tensor:
    """The local tensor of a DTensor; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def parameter_bytes(param: Tensor, spec: ParamSpec) -> int:
    """Bytes a parameter holds: FSDP2's padded storage, else its local shape."""
    piece = local(param)
    if spec.fsdp:
        return piece.untyped_storage().nbytes()
    return piece.numel() * piece.element_size()


def gradient_bytes(param: Tensor, spec: ParamSpec, reduce_itemsize: int) -> int:
    """Bytes of a parameter's gradient after backward (the module docstring).

    Args:
        param: the parameter.
        spec: its spec.
        reduce_itemsize: bytes per element of FSDP2's reduction (its reduce-scatter output).
    """
    if not spec.trainable:
        return 0
    piece = local(param)
    if spec.fsdp and reduce_itemsize == piece.element_size():
        return piece.untyped_storage().nbytes()  # a view of the padded reduce-scatter output
    return piece.numel() * piece.element_size()  # its own tensor (or a cast of the reduced shard)


def optimizer_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every state tensor of ``optimizers`` (local tensors of DTensor state, each tensor once)."""
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    piece = local(value)
                    total += piece.numel() * piece.element_size()
    return total


def optimizers_of(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in what ``configure_optimizers`` returned (any of the forms Lightning accepts).

    Raises:
        ValueError: nothing that holds an optimizer.
    """
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, dict):
        return optimizers_of(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        found = [o for item in configured for o in _optimizers_or_empty(item)]
        if found:
            return found
    raise ValueError(f"configure_optimizers returned {type(configured).__name__}, which holds no torch optimizer: "
                     "return an optimizer, a dict with 'optimizer', or a list of them, as Lightning accepts.")


def _optimizers_or_empty(item: Any) -> list[torch.optim.Optimizer]:
    try:
        return optimizers_of(item)
    except ValueError:
        return []  # e.g. the list of schedulers in ([optimizers], [schedulers])


def first_step(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """One optimizer step on ``meta`` with zero gradients, so every optimizer creates the state it really keeps."""
    with torch.no_grad():
        for param in module.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    for optimizer in optimizers:
        optimizer.step()
    module.zero_grad(set_to_none=True)
