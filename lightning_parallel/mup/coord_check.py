"""The coordinate check (Tensor Programs V, section 7.1): do activations and their updates keep their size as the
width grows?

A model is built at several widths from the same seed and trained a few steps on the same batches; before the first
step and after each, a fixed probe batch goes through it and, for each named layer, the mean ``|output|`` (the
activation's coordinate size) and the mean ``|output - output at step 0|`` (how far the training moved it) are
recorded. Under μP both stay flat across widths; under the standard parametrisation with one learning rate the
updates grow with the width (an Adam step moves each of a matrix's ``fan_in`` entries by about ``lr``, so its
output moves by about ``lr x fan_in``) and the logits blow up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class CoordinateRecord:
    """One width's coordinate sizes.

    Attributes:
        width: the model's width.
        activation: layer -> mean ``|output|`` on the probe batch, at step 0 (init) and after each step.
        update: layer -> mean ``|output - output at step 0|``, after each step (index 0: after the first).
        losses: the training loss of each step.
    """

    width: int
    activation: dict[str, list[float]] = field(default_factory=dict)
    update: dict[str, list[float]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)


def _outputs(model: nn.Module, layers: Sequence[str], probe: Any) -> dict[str, Tensor]:
    """Each named layer's output (its first tensor) for ``probe``, without gradients."""
    seen: dict[str, Tensor] = {}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda _m, _i, out, name=name: seen.__setitem__(name, (out[0] if isinstance(out, tuple) else out).detach()))
        for name in layers]
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def coordinate_check(
    build: Callable[[int], tuple[nn.Module, torch.optim.Optimizer]],
    widths: Sequence[int],
    layers: Sequence[str],
    batches: Sequence[Any],
    loss: Callable[[nn.Module, Any], Tensor],
    probe: Any,
    seed: int = 0,
) -> dict[int, CoordinateRecord]:
    """Train a model at each width ``len(batches)`` steps and record its layers' coordinate sizes (module docstring).

    Args:
        build: ``build(width) -> (model, optimizer)``; called after seeding with ``seed``.
        widths: the widths to compare (smallest first).
        layers: submodule names whose outputs are measured (each block, the head).
        batches: one training batch per step (the same at every width).
        loss: ``loss(model, batch)`` -> the scalar to minimise.
        probe: the model's input the sizes are measured on (the same at every width and step).
        seed: the seed every width starts from.
    """
    records = {}
    for width in widths:
        torch.manual_seed(seed)
        model, optimizer = build(width)
        record = CoordinateRecord(width)
        start = _outputs(model, layers, probe)
        for name in layers:
            record.activation[name] = [float(start[name].abs().mean())]
            record.update[name] = []
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            value = loss(model, batch)
            value.backward()
            optimizer.step()
            record.losses.append(float(value.detach()))
            now = _outputs(model, layers, probe)
            for name in layers:
                record.activation[name].append(float(now[name].abs().mean()))
                record.update[name].append(float((now[name] - start[name]).abs().mean()))
        records[width] = record
    return records


def growth(records: dict[int, CoordinateRecord], quantity: str, layer: str, step: int = -1) -> float:
    """How much ``quantity`` (``"activation"`` or ``"update"``) of ``layer`` at ``step`` grew from the smallest width
    to the largest: ``value(largest) / value(smallest)`` (1: flat).

    Args:
        records: :func:`coordinate_check`'s result.
        quantity: ``"activation"`` or ``"update"``.
        layer: the layer's name.
        step: the step's index in the record's list (-1: the last).
    """
    widths = sorted(records)
    first, last = (getattr(records[w], quantity)[layer][step] for w in (widths[0], widths[-1]))
    return last / first
