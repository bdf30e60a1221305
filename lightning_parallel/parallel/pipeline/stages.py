"""Cutting a module into pipeline stages that keep every parameter under its original name.

torchtitan's approach: layers a rank does not run are replaced in the module by an empty
:class:`RemovedLayer`, so ``module.parameters()`` and ``module.state_dict()`` hold this
rank's layers only, under the names of the unsplit model -- which is what lets a
checkpoint load under any pipeline size. A :class:`StageModule` registers the kept layers
(the very same objects) under those names and runs them in order.

Stages may pass several tensors: a layer that returns a tuple hands its elements to the
next layer as positional arguments (and across a stage boundary torch sends each). Side
inputs -- batch-first tensors every stage needs but no layer computes (a padding mask) --
reach every stage as keyword arguments, split per micro-batch like the batch itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.pipeline.partition import Partition, parameter_counts, stage_of_layer

SideInputs = Callable[[Any], dict]


class RemovedLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline stage (holds no parameters).

    Args:
        name: the layer's qualified name in the module.
        stage: the stage that owns it.
    """

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.layer_name, self.stage = name, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_name!r} lives on pipeline stage {self.stage}; this rank cannot run it. "
            "Under a pipeline strategy the forward pass runs through the pipeline schedule, not module(x)."
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name!r} on stage {self.stage}"


def layer_names(module: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Qualified names of ``layers`` inside ``module``, checking they cover its parameters.

    A parameter shared by two layers (tied embeddings) is allowed: see
    :func:`shared_parameters` and :mod:`lightning_parallel.parallel.pipeline.tied`.

    Raises:
        ValueError: a layer that is not a submodule, layers nested in each other, or a
            parameter outside every layer.
    """
    by_id = {id(m): name for name, m in module.named_modules()}
    names = []
    for index, layer in enumerate(layers):
        name = by_id.get(id(layer))
        if not name:
            raise ValueError(
                f"pipeline_layers()[{index}] ({type(layer).__name__}) is not a submodule of {type(module).__name__} "
                "(or is the module itself): return the model's own blocks, in order."
            )
        names.append(name)
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"pipeline layers {a!r} and {b!r} are nested: return non-overlapping blocks.")
    covered = {id(p) for layer in layers for p in layer.parameters()}
    orphans = [n for n, p in module.named_parameters() if id(p) not in covered]
    if orphans:
        raise ValueError(
            f"Parameters outside every pipeline layer would be lost by the split: {orphans[:5]}. "
            "Include the modules that hold them in pipeline_layers()."
        )
    return names


def shared_parameters(names: Sequence[str], layers: Sequence[nn.Module]) -> list[tuple[tuple[int, str], ...]]:
    """Parameters held by more than one layer, each as ``((layer index, qualified name), ...)`` in layer order."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for index, (name, layer) in enumerate(zip(names, layers)):
        for pname, param in layer.named_parameters(remove_duplicate=False):
            entries = holders.setdefault(id(param), [])
            if all(i != index for i, _ in entries):
                entries.append((index, f"{name}.{pname}"))
    return [tuple(entries) for entries in holders.values() if len(entries) > 1]


class StageModule(nn.Module):
    """The layers of one pipeline stage, registered under their original qualified names.

    The layers are the very module objects of the full model (not copies), so training
    them trains the model, and ``state_dict()`` keys match the unsplit model's.

    Args:
        named_layers: ``(qualified name, layer)`` pairs in forward order.
        side_inputs: ``inputs -> {name: batch-first tensor}`` (the module's
            ``pipeline_side_inputs``); each layer gets the keywords its ``forward`` accepts.
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]], side_inputs: Optional[SideInputs] = None) -> None:
        super().__init__()
        self.order = [name for name, _ in named_layers]
        self.side_inputs = side_inputs
        for name, layer in named_layers:
            self.attach(name, layer)
        self._accepted: dict[str, Optional[frozenset]] = {}

    def attach(self, name: str, module: nn.Module) -> None:
        """Register ``module`` under its dotted ``name``, creating empty parents as needed."""
        parent: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)

    def stage_arguments(self, inputs: Any) -> tuple[tuple, dict]:
        """``(positional inputs of the first stage, keyword side inputs of every stage)`` for one batch."""
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return args, dict(self.side_inputs(inputs)) if self.side_inputs is not None else {}

    def _keywords(self, name: str, layer: nn.Module, side: dict) -> dict:
        if name not in self._accepted:
            params = inspect.signature(layer.forward).parameters.values()
            open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
            self._accepted[name] = None if open_ended else frozenset(p.name for p in params)
        accepted = self._accepted[name]
        return dict(side) if accepted is None else {k: v for k, v in side.items() if k in accepted}

    def forward(self, *values: Any, **side: Any) -> Any:
        values = tuple(contiguous_gradient(v) for v in values)
        for name in self.order:
            layer = self.get_submodule(name)
            out = layer(*values, **self._keywords(name, layer, side)) if side else layer(*values)
            values = out if isinstance(out, tuple) else (out,)
        return values[0] if len(values) == 1 else values


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def contiguous_gradient(value: Any) -> Any:
    """``value`` unchanged, but its gradient made contiguous.

    Note:
        A stage's input gradients are sent back to the previous stage, whose receive buffers
        copy their strides; gloo refuses non-contiguous buffers, and a gradient flowing back
        through ``torch.cat`` of two inputs is a strided slice.
    """
    if isinstance(value, Tensor) and value.requires_grad:
        return _ContiguousGradient.apply(value)
    return value


StageFactory = Callable[[Sequence[tuple[str, nn.Module]]], StageModule]


@dataclass(frozen=True)
class PipelineSplit:
    """Which layers each stage owns, and what this rank holds.

    Attributes:
        names: qualified name of every pipeline layer, in order.
        bounds: stage boundaries (``num_stages + 1`` layer indices).
        local_stages: stage indices this rank runs.
        parameters_per_stage: parameter elements of each stage.
        shared: parameters held by several layers (``((layer index, qualified name), ...)``).
    """

    names: tuple[str, ...]
    bounds: tuple[int, ...]
    local_stages: tuple[int, ...]
    parameters_per_stage: tuple[int, ...]
    shared: tuple[tuple[tuple[int, str], ...], ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        return self.names[self.bounds[stage] : self.bounds[stage + 1]]

    def stage_of(self, layer_index: int) -> int:
        """The stage that owns layer number ``layer_index``."""
        return stage_of_layer(list(self.bounds))[layer_index]

    def describe(self) -> dict[str, str]:
        """One line per stage: its layers and parameter count (for the start-up table)."""
        rows = {}
        for stage in range(self.num_stages):
            layers = self.stage_layers(stage)
            span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
            rows[f"stage {stage}"] = f"{len(layers)} layer(s) ({span}), {self.parameters_per_stage[stage]:,} params"
        return rows


def split_module(
    module: nn.Module,
    layers: Sequence[nn.Module],
    bounds: Partition,
    local_stages: Sequence[int],
    make_stage: Optional[StageFactory] = None,
) -> tuple[PipelineSplit, list[StageModule]]:
    """Keep only this rank's stages in ``module``; return the split and the local stage modules.

    Layers of other stages are replaced in ``module`` by :class:`RemovedLayer`, freeing
    their parameters, so ``module.parameters()`` (what ``configure_optimizers`` sees) and
    ``module.state_dict()`` hold this rank's layers only, under their original names. A
    parameter shared by layers of two ranks (tied embeddings) stays on both; keeping the
    copies equal is :mod:`~lightning_parallel.parallel.pipeline.tied`'s job.

    Args:
        module: the full model (modified in place).
        layers: its pipeline layers, in order.
        bounds: stage boundaries from :func:`~lightning_parallel.parallel.pipeline.partition.partition_layers`.
        local_stages: stage indices this rank runs.
        make_stage: builds a stage from ``(name, layer)`` pairs (default :class:`StageModule`).
    """
    names = layer_names(module, layers)
    counts = parameter_counts(layers)
    owner = stage_of_layer(list(bounds))
    per_stage = tuple(sum(counts[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1))
    shared = tuple(shared_parameters(names, layers))
    split = PipelineSplit(tuple(names), tuple(bounds), tuple(local_stages), per_stage, shared)
    make_stage = make_stage or StageModule
    stages = [make_stage([(names[i], layers[i]) for i in range(bounds[s], bounds[s + 1])]) for s in local_stages]
    for index, name in enumerate(names):
        if owner[index] not in local_stages:
            module.set_submodule(name, RemovedLayer(name, owner[index]))
    return split, stages
