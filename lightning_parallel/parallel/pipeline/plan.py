"""What the pipeline needs from a model (:class:`PipelinePlan`), and the plan of a module that follows the protocol.

Who supplies a plan is the model adapter's business
(:meth:`~lightning_parallel.parallel.adapter.ModelAdapter.pipeline_plan`): the module's own
protocol methods (:func:`protocol_plan`), or an adapter that understands a model family (a
Hugging Face decoder). The engine only reads the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

from torch import Tensor, nn

from lightning_parallel.parallel.pipeline.runner import default_item_count
from lightning_parallel.parallel.pipeline.stages import StageFactory, StageModule


@dataclass(frozen=True)
class PipelinePlan:
    """What the pipeline needs from a module, whoever supplied it.

    Attributes:
        names: qualified name of every pipeline layer, in order.
        layers: the layers themselves.
        make_stage: builds a stage module from ``(name, layer)`` pairs.
        loss_fn: ``(output, target) -> mean loss`` or ``-> (loss_sum, num_items)``.
        count_items: ``targets -> items carrying a loss`` (for token-weighted losses).
        source: who supplied the plan, for messages (``"protocol"`` or the model class).
        sample: ``() -> (inputs, forward's output)`` for the one-process chain check, or None
            when no input is known.
        loss_terms: whether ``loss_fn`` returns ``(loss_sum, num_items)`` terms (weighted by
            item counts over micro-batches and data-parallel ranks) rather than a mean.
        timeable: whether each layer can be timed on one tensor (``partition="time"``); False
            for layers that also need masks or positions built by the model.
    """

    names: tuple[str, ...]
    layers: tuple[nn.Module, ...]
    make_stage: StageFactory
    loss_fn: Callable[[Any, Any], Any]
    count_items: Callable[[Any], Tensor]
    source: str
    sample: Optional[Callable[[], tuple[Any, Any]]] = field(default=None, compare=False)
    loss_terms: bool = False
    timeable: bool = True


def own_loss(module: nn.Module) -> Optional[Callable[[Any, Any], Any]]:
    """The module's ``pipeline_loss_terms`` (preferred: it weighs items exactly), else its ``pipeline_loss``."""
    for name in ("pipeline_loss_terms", "pipeline_loss"):
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def defines_loss_terms(module: nn.Module) -> bool:
    """Whether the module's own last-stage loss comes as ``(loss_sum, num_items)`` terms."""
    return callable(getattr(module, "pipeline_loss_terms", None))


def layer_qualified_names(module: nn.Module, layers: Sequence[nn.Module]) -> tuple[str, ...]:
    """The qualified name of each of ``layers`` inside ``module`` (``""`` for one it does not hold)."""
    by_id = {id(m): name for name, m in module.named_modules()}
    return tuple(by_id.get(id(layer), "") for layer in layers)


def _protocol_sample(module: nn.Module) -> Optional[Callable[[], tuple[Any, Any]]]:
    example = getattr(module, "example_input_array", None)
    if example is None:
        return None

    def run() -> tuple[Any, Any]:
        args = example if isinstance(example, tuple) else (example,)
        return example, module(*args)

    return run


def protocol_plan(module: nn.Module) -> PipelinePlan:
    """The plan of a module that defines ``pipeline_layers()`` and a loss (see :mod:`lightning_parallel.protocol`).

    Args:
        module: the LightningModule (or any module following the protocol).

    Raises:
        ValueError: the module defines ``pipeline_layers()`` but no loss for the last stage.
    """
    loss = own_loss(module)
    if loss is None:
        raise ValueError(
            f"{type(module).__name__} defines pipeline_layers() but no loss for the last stage: define "
            "pipeline_loss_terms(output, target) -> (loss_sum, num_items) or pipeline_loss(output, target)."
        )
    layers = tuple(module.pipeline_layers())
    side = getattr(module, "pipeline_side_inputs", None)
    make_stage = partial(StageModule, side_inputs=side) if callable(side) else StageModule
    return PipelinePlan(
        layer_qualified_names(module, layers), layers, make_stage, loss, default_item_count, "protocol",
        _protocol_sample(module), loss_terms=defines_loss_terms(module),
    )
