"""Which parameter each optimizer position is: the param groups of a checkpoint that stores positions only.

torch's optimizer ``state_dict`` -- what Lightning's single-device, DDP and FSDP full-state
files and DeepSpeed ZeRO-0 folders hold -- numbers the parameters 0, 1, ... over the param
groups in the order ``configure_optimizers`` listed them, and keeps no names. Two sources of
names are used here:

- :func:`infer_group_names`, from the checkpoint alone: each group is taken to list its
  parameters in module order (``self.parameters()``, or ``named_parameters()`` filtered
  into groups, as weight-decay groups are built), and every position's state tensors must
  have the shape of the weight it is given. Every assignment that satisfies both is
  counted; exactly one is accepted, none or several are refused (:class:`PositionsUnknown`).
- :func:`module_group_names`, from the LightningModule itself: its class, built from the
  checkpoint's hyper-parameters on the meta device, runs ``configure_optimizers`` and the
  live param groups name the positions (``lp-convert --module``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

# What names the fix wherever the positions cannot be told apart (lp-convert and the library alike).
REMEDY = ("Name the LightningModule class so its configure_optimizers tells the groups (lp-convert --module "
          "package.module.Class; in Python, group_names=), or leave the optimizer state out (lp-convert "
          "--no-optimizer, or --to pt / --to hf for the weights).")
# Reachable states of the search before it gives up: far above what shapes that tell groups apart need.
_STATE_BUDGET = 200_000

Shape = Optional[tuple[int, ...]]


class PositionsUnknown(ValueError):
    """The optimizer's positions cannot be matched to parameter names from the checkpoint alone."""


def state_shape(entry: Optional[dict[str, Any]]) -> Shape:
    """The shape a position's state says its parameter has (its first non-scalar tensor), or None if it has none."""
    for value in (entry or {}).values():
        if torch.is_tensor(value) and value.dim() > 0:
            return tuple(value.shape)
    return None


def _successors(state: tuple[int, ...], index: int, slots: list[list[Shape]], shape: Any, spare: int) -> list[Any]:
    """``(group, next state)`` for every way weight ``index`` can be placed from ``state`` (group None: skipped).

    ``state`` counts the positions filled per group; a weight is skipped (a buffer or a frozen
    parameter) only while fewer than ``spare`` weights have been.
    """
    moves: list[Any] = [(None, state)] if index - sum(state) < spare else []
    for group, filled in enumerate(state):
        if filled < len(slots[group]) and slots[group][filled] in (None, shape):
            moves.append((group, state[:group] + (filled + 1,) + state[group + 1:]))
    return moves


def _forward(slots: list[list[Shape]], shapes: list[tuple[int, ...]], spare: int) -> list[set[tuple[int, ...]]]:
    """The states reachable before each weight (and after the last), in module order."""
    reachable = [{tuple(0 for _ in slots)}]
    for index, shape in enumerate(shapes):
        reachable.append({nxt for state in reachable[-1] for _, nxt in _successors(state, index, slots, shape, spare)})
        if sum(map(len, reachable)) > _STATE_BUDGET:
            raise PositionsUnknown("too many ways remain open to tell the groups apart")
    return reachable


def _assign(slots: list[list[Shape]], names: list[str], shapes: list[tuple[int, ...]]) -> list[list[str]]:
    """The one assignment of ``names`` to ``slots`` (see the module docstring); PositionsUnknown otherwise."""
    spare = len(names) - sum(map(len, slots))
    if spare < 0:
        raise PositionsUnknown(f"the optimizer holds {-spare} more parameters than the checkpoint has weights")
    reachable = _forward(slots, shapes, spare)
    start, final = tuple(0 for _ in slots), tuple(map(len, slots))
    # ways[i][state]: the assignments (counted up to 2) that complete from ``state`` before weight i.
    ways: list[dict[tuple[int, ...], int]] = [{} for _ in reachable]
    ways[-1] = {final: 1} if final in reachable[-1] else {}
    for index in range(len(names) - 1, -1, -1):
        ways[index] = {state: min(2, sum(ways[index + 1].get(nxt, 0)
                                         for _, nxt in _successors(state, index, slots, shapes[index], spare)))
                       for state in reachable[index]}
    count = ways[0].get(start, 0)
    if count != 1:
        raise PositionsUnknown("no assignment fits the shapes of the state" if count == 0 else
                               "more than one assignment fits (parameters of one shape in several groups, or "
                               "positions without state to tell them apart)")
    groups: list[list[str]] = [[] for _ in slots]
    state = start
    for index, name in enumerate(names):
        group, state = next(move for move in _successors(state, index, slots, shapes[index], spare)
                            if ways[index + 1].get(move[1]))
        if group is not None:
            groups[group].append(name)
    return groups


def infer_group_names(
    optimizer_state: dict[str, Any], candidates: Sequence[tuple[str, torch.Tensor]]
) -> list[list[str]]:
    """The parameter names of each param group of a position-keyed optimizer ``state_dict``.

    Args:
        optimizer_state: ``{"state": {position: {...}}, "param_groups": [{..., "params": [positions]}]}``.
        candidates: ``(name, weight)`` of every weight that may be a parameter, in module order, a tied
            tensor once (buffers and frozen parameters among them are skipped where the shapes allow).

    Raises:
        PositionsUnknown: no assignment, or more than one, fits (the message names the fix).
    """
    groups = optimizer_state["param_groups"]
    slots = [[state_shape(optimizer_state["state"].get(p)) for p in group["params"]] for group in groups]
    names, shapes = [name for name, _ in candidates], [tuple(weight.shape) for _, weight in candidates]
    try:
        return _assign(slots, names, shapes)
    except PositionsUnknown as why:
        try:  # forced whatever the shapes say (one group over every weight): the caller names what does not fit
            return _assign([[None] * len(slot) for slot in slots], names, shapes)
        except PositionsUnknown:
            pass
        raise PositionsUnknown(
            f"The optimizer's {sum(map(len, slots))} parameters in {len(groups)} param group(s) cannot be matched to "
            f"the checkpoint's {len(names)} weights by position: {why}, taking each group to list its parameters in "
            f"module order. {REMEDY}"
        ) from None


def _optimizers(answer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in any of the forms ``configure_optimizers`` may return (Lightning's documented ones)."""
    if isinstance(answer, torch.optim.Optimizer):
        return [answer]
    if isinstance(answer, dict):
        return _optimizers(answer.get("optimizer"))
    if isinstance(answer, (list, tuple)):
        return [optimizer for item in answer for optimizer in _optimizers(item)]
    return []  # a scheduler, or None


def _build(class_path: str, hyper_parameters: dict[str, Any], hparams_name: Optional[str]) -> nn.Module:
    """The LightningModule ``class_path`` built on the meta device as ``load_from_checkpoint`` would call it."""
    module_name, _, class_name = class_path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"--module {class_path!r} names no importable class ({error}): give package.module.Class.")
    kwargs = hyper_parameters if hparams_name in (None, "kwargs") else {hparams_name: hyper_parameters}
    with torch.device("meta"):  # no storage: only the parameters' identities and names are read
        module = cls(**kwargs)
        if callable(getattr(module, "configure_model", None)):
            module.configure_model()  # modules that build their layers there (Lightning's hook)
    return module


def module_group_names(
    class_path: str, hyper_parameters: dict[str, Any], hparams_name: Optional[str] = None
) -> list[list[list[str]]]:
    """Per optimizer, the parameter names of each param group, from the module's own ``configure_optimizers``.

    Args:
        class_path: ``package.module.Class`` of the LightningModule that wrote the checkpoint.
        hyper_parameters: the checkpoint's ``hyper_parameters`` (plain containers), passed to the class.
        hparams_name: the checkpoint's ``hparams_name`` (``"kwargs"``: passed as keyword arguments).

    Raises:
        ValueError: the class cannot be imported, built from the hyper-parameters or asked for its optimizers.
    """
    try:
        module = _build(class_path, hyper_parameters, hparams_name)
        optimizers = _optimizers(module.configure_optimizers())
    except ValueError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code: any failure becomes the one-line refusal
        raise ValueError(f"Building {class_path} from the checkpoint's hyper-parameters on the meta device and "
                         f"calling configure_optimizers failed ({type(error).__name__}: {error}).") from None
    if not optimizers:
        raise ValueError(f"{class_path}.configure_optimizers returned no optimizer.")
    names = {id(param): name for name, param in module.named_parameters()}
    return [[[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]
            for optimizer in optimizers]
