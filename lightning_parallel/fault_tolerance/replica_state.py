"""What a healthy replica group sends a recovering one: this rank's parameters, optimizer and scheduler state,
and where the data stands.

Note:
    torchft ships a state dict between the same group rank of two replica groups (``HTTPTransport``: a
    ``torch.save`` stream). Replica groups share one layout, so rank ``r`` of every group holds the same shards;
    DTensors travel as their local tensors (what every rank of a group already agrees on) and are rebuilt with
    the receiving parameter's mesh and placements, which is why this module exists instead of
    ``module.state_dict()`` as is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def local(value: Any) -> Any:
    """The local tensor of a DTensor; anything else unchanged."""
    return value.to_local() if isinstance(value, DTensor) else value


def _to_local_tree(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local_tree(v) for v in value)
    return local(value).detach() if isinstance(value, torch.Tensor) else value


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers this rank holds (meta placeholders of other pipeline stages left out)."""
    return {name: local(t).detach() for name, t in module.state_dict().items()
            if isinstance(t, torch.Tensor) and local(t).device.type != "meta"}


@torch.no_grad()
def load_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into this rank's parameters and buffers in place (DTensor shards included).

    Raises:
        ValueError: the sender holds other tensors than this rank (the replica groups' layouts differ).
    """
    targets = {name: t for name, t in module.state_dict().items() if name in state}
    missing = sorted(set(state) - set(targets))
    if missing:
        raise ValueError(f"Recovery state names tensors this rank does not hold ({missing[:3]}...): every replica "
                         f"group must run the same model and layout.")
    for name, target in targets.items():
        destination = local(target)
        if destination.shape != state[name].shape:
            raise ValueError(f"Recovery state {name!r} has shape {tuple(state[name].shape)}, this rank holds "
                             f"{tuple(destination.shape)}: every replica group must run the same layout.")
        destination.copy_(state[name])


def optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with DTensor state as local tensors."""
    return _to_local_tree(optimizer.state_dict())


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`optimizer_state` output, rebuilding per-parameter state as DTensors like their parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = {}
    for index, entry in state["state"].items():
        param = params[int(index)]
        rebuilt[index] = {key: _like(param, value) for key, value in entry.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


def _like(param: torch.Tensor, value: Any) -> Any:
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def state_functions(module: nn.Module, optimizers: Callable[[], list[Optimizer]], schedulers: Callable[[], list[Any]],
                    position: Callable[[], dict[str, Any]], on_load: Callable[[dict[str, Any]], None],
                    ) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """``(state_dict, load_state_dict)`` for torchft's manager.

    Args:
        module: the trained module (this rank's share).
        optimizers: returns the torch optimizers (not Lightning's wrappers).
        schedulers: returns the LR schedulers.
        position: returns where the sender stands: ``{"epoch": e, "batch": b, "step": s}`` of the step being
            taken, and ``"loop"``, its fit loop for a group healing at start-up (:mod:`.loop_state`).
        on_load: receives the sender's position after its state is loaded.
    """

    def state_dict() -> dict[str, Any]:
        return {"module": module_state(module), "optimizers": [optimizer_state(o) for o in optimizers()],
                "schedulers": [s.state_dict() for s in schedulers()], "position": dict(position())}

    def load_state_dict(state: dict[str, Any]) -> None:
        load_module_state(module, state["module"])
        for optimizer, saved in zip(optimizers(), state["optimizers"], strict=True):
            load_optimizer_state(optimizer, saved)
        for scheduler, saved in zip(schedulers(), state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        on_load(state["position"])

    return state_dict, load_state_dict
