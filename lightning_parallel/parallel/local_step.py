"""The optimizer step on the local tensors of DTensor parameters: no DTensor dispatch per parameter and op.

Under FSDP2 (ZeRO 2/3, HSDP, ZeRO 0 beside other axes) and tensor parallelism every parameter,
gradient and optimizer state is a DTensor, and a torch optimizer's step runs each of its element-wise
ops through DTensor's dispatcher: sharding propagation and a wrapper per op and parameter. That is
pure overhead for an element-wise update -- each rank updates exactly its local shard with its local
gradient shard -- and measured 2.5x the same optimizer on plain tensors on this machine
(``benchmarks/data_axis_comm.py``). FSDP2 users on GPUs avoid it with fused/foreach optimizers over
the local shards; torch has no public switch for it, so :func:`step_on_local_shards` gives the
optimizer a view of itself in local tensors for the length of its update: ``param_groups`` hold each
DTensor parameter's local tensor (a view of the same storage) with its local gradient, ``state`` the
local tensors of the DTensor states (the same storage: updates write through), and new state the
step creates is wrapped back as DTensors with the parameter's mesh and placements, so checkpoints,
resharding and everything outside the step see DTensors as before. The numbers are those of the
DTensor path: DTensor runs the same local ops.

Only optimizers whose update is element-wise are switched (:data:`ELEMENTWISE`): one that reads a
whole parameter (LAMB's trust ratio, Adafactor's factored moments, Shampoo, Muon) would see a shard
and compute something else, so it keeps the DTensor path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel import _compat

# torch optimizers whose update of each element reads only that element's parameter, gradient and state.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta)


def step_on_local_shards(optimizers: Iterable[Optimizer]) -> list[Optimizer]:
    """Make each element-wise optimizer with DTensor parameters step on their local tensors; returns those switched.

    Args:
        optimizers: torch optimizers (unwrapped from Lightning's ``LightningOptimizer``). The closure Lightning
            passes to ``step`` (forward, backward, clipping) runs first, on the DTensors, as before.
    """
    from torch.distributed.tensor import DTensor

    switched = []
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if type(optimizer) not in ELEMENTWISE or not any(isinstance(p, DTensor) for p in params):
            continue
        if getattr(optimizer, "steps_on_local_shards", False):
            continue  # fit() again with the same optimizer
        inner = optimizer.step

        def step(closure: Optional[Any] = None, _inner: Any = inner, _optimizer: Optimizer = optimizer) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            with local_view(_optimizer):
                _inner()
            return loss

        _compat.keep_lr_scheduler_marker(step, inner)  # a scheduler made before the switch must not warn
        optimizer.step = step
        optimizer.steps_on_local_shards = True
        switched.append(optimizer)
    return switched


@contextmanager
def local_view(optimizer: Optimizer) -> Iterator[None]:
    """``optimizer`` sees the local tensors of its DTensor parameters and states inside (module docstring).

    Args:
        optimizer: a torch optimizer; plain parameters in it are left as they are.
    """
    from torch.distributed.tensor import DTensor

    state, saved = optimizer.state, [group["params"] for group in optimizer.param_groups]
    local_state: defaultdict = defaultdict(dict)
    pairs: list[tuple[Tensor, Tensor]] = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            group["params"] = [_local_param(p, state, local_state, pairs) if isinstance(p, DTensor) else p
                               for p in group["params"]]
        for p in (p for params in saved for p in params if not isinstance(p, DTensor) and p in state):
            local_state[p] = state[p]
    optimizer.state = local_state
    try:
        yield
    finally:
        optimizer.state = state
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        for p, local in pairs:
            local.grad = None
            if local in local_state:
                old = state.get(p, {})
                state[p] = {k: _as_dtensor(v, p, local, old.get(k)) for k, v in local_state[local].items()}
        for p in (p for params in saved for p in params if not isinstance(p, DTensor) and p in local_state):
            state[p] = local_state[p]


def _local_param(p: Any, state: Any, local_state: Any, pairs: list) -> Tensor:
    """``p``'s local tensor with its local gradient, its state's local tensors filed under it."""
    from torch.distributed.tensor import DTensor

    local = p.to_local()
    local.grad = p.grad.to_local() if p.grad is not None else None
    if p in state:
        local_state[local] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state[p].items()}
    pairs.append((p, local))
    return local


def _as_dtensor(value: Any, p: Any, local: Tensor, old: Any) -> Any:
    """A state value back in DTensor form: the DTensor it was a view of, a new one for a new tensor shaped like the
    local parameter (placed as the parameter), anything else (scalars, the step count) as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(old, DTensor) and old.to_local() is value:
        return old
    if isinstance(value, Tensor) and value.dim() > 0 and value.shape == local.shape:
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return value
