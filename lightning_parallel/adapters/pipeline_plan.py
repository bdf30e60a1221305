"""How a module splits into pipeline stages: from its own protocol methods, or from a Hugging Face model's plan.

The module's protocol methods (:mod:`lightning_parallel.protocol`) always win; a module
that defines none is split by an adapter that understands it (today: a Hugging Face
decoder-only causal LM held as a submodule). Anything else is a ``ValueError`` naming
what is missing and what to define.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.adapters.hf import causal_lm_loss_terms, causal_lm_valid_count, find_hf_model
from lightning_parallel.adapters.hf_pipeline import HFStage, hf_pipeline_layers
from lightning_parallel.parallel.pipeline.runner import default_item_count
from lightning_parallel.parallel.pipeline.stages import StageFactory, StageModule

SAMPLE_SHAPE = (2, 8)  # the Hugging Face chain check's synthetic batch: tiny, with one padded row


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
    """

    names: tuple[str, ...]
    layers: tuple[nn.Module, ...]
    make_stage: StageFactory
    loss_fn: Callable[[Any, Any], Any]
    count_items: Callable[[Any], Tensor]
    source: str
    sample: Optional[Callable[[], tuple[Any, Any]]] = field(default=None, compare=False)


def _own_loss(module: nn.Module) -> Optional[Callable[[Any, Any], Any]]:
    for name in ("pipeline_loss_terms", "pipeline_loss"):  # terms first: they weigh items exactly
        method = getattr(module, name, None)
        if callable(method):
            return method
    return None


def _names(module: nn.Module, layers: Sequence[nn.Module]) -> tuple[str, ...]:
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
    """The plan of a module that defines ``pipeline_layers()`` and a loss (see the protocol)."""
    loss = _own_loss(module)
    if loss is None:
        raise ValueError(
            f"{type(module).__name__} defines pipeline_layers() but no loss for the last stage: define "
            "pipeline_loss_terms(output, target) -> (loss_sum, num_items) or pipeline_loss(output, target)."
        )
    layers = tuple(module.pipeline_layers())
    side = getattr(module, "pipeline_side_inputs", None)
    make_stage = partial(StageModule, side_inputs=side) if callable(side) else StageModule
    return PipelinePlan(
        _names(module, layers), layers, make_stage, loss, default_item_count, "protocol", _protocol_sample(module)
    )


def _hf_sample(module: nn.Module, model: nn.Module) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, model.config.vocab_size, SAMPLE_SHAPE, generator=generator).to(device)
        attention_mask = torch.ones(SAMPLE_SHAPE, dtype=torch.long, device=device)
        attention_mask[1, -3:] = 0  # a padded row: the chain must apply the padding mask as forward does
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        return inputs, model(**inputs, use_cache=False).logits

    return run


def hf_plan(module: nn.Module, prefix: str, model: nn.Module) -> PipelinePlan:
    """The plan of a module holding a Hugging Face causal LM at ``prefix`` (its own loss methods win)."""
    named = hf_pipeline_layers(prefix, model)
    roles = {name: role for name, _, role in named}
    own = _own_loss(module)
    return PipelinePlan(
        tuple(name for name, _, _ in named),
        tuple(layer for _, layer, _ in named),
        partial(HFStage, roles=roles, model=model),
        own or causal_lm_loss_terms,
        causal_lm_valid_count if own is None else default_item_count,
        type(model).__name__,
        _hf_sample(module, model),
    )


def pipeline_plan(module: nn.Module) -> PipelinePlan:
    """How ``module`` splits into pipeline stages.

    Args:
        module: the LightningModule (or any module).

    Raises:
        ValueError: the module defines no ``pipeline_layers()`` and holds no Hugging Face
            model the adapter understands (the message names what is missing and the remedy).
    """
    if callable(getattr(module, "pipeline_layers", None)):
        return protocol_plan(module)
    found = find_hf_model(module)
    if found is not None:
        return hf_plan(module, *found)
    raise ValueError(
        f"{type(module).__name__} cannot be split into pipeline stages: it defines no pipeline_layers() and holds no "
        "Hugging Face model. Implement the module protocol (pipeline_layers and pipeline_loss_terms or pipeline_loss; "
        "see lightning_parallel/protocol.py and the README)."
    )
