"""transformers' private or undocumented parts the suite relies on: a model's class-level parallel plans, its
per-module initialiser, its attention switch, its checkpoint-key conversions (the door:
:mod:`lightning_parallel._compat`).

Each touch point says why it is private; ``tests/unit/test_compat.py`` has a canary for each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from torch import nn


def attention_implementation(model: nn.Module) -> Optional[str]:
    """The attention implementation a transformers model runs (``"sdpa"``, ``"eager"``, a registered name).

    Why private: transformers keeps it as ``config._attn_implementation`` and offers only a setter
    (``set_attn_implementation``); context parallelism checks that the switch took.
    """
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def can_set_attention_implementation(model: nn.Module) -> bool:
    """Whether ``set_attn_implementation`` can swap a transformers model's attention (it calls attention through
    ``AttentionInterface``). Why private: transformers' own test, ``_can_set_attn_implementation``, is private; a
    model without it (older transformers) is taken at its word."""
    check = getattr(type(model), "_can_set_attn_implementation", None)
    return callable(getattr(model, "set_attn_implementation", None)) and (not callable(check) or bool(check()))


def hf_class_plans(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The class-level ``(_tp_plan, _pp_plan)`` of a transformers model (empty dicts when absent).

    Why private: transformers keeps the LM head's part of its parallel plans (``lm_head``:
    ``colwise_gather_output`` / ``(["hidden_states"], ["logits"])``) only in these class
    attributes; the base model's part is public (``config.base_model_tp_plan``/``_pp_plan``).
    """
    cls = type(model)
    return dict(getattr(cls, "_tp_plan", None) or {}), dict(getattr(cls, "_pp_plan", None) or {})


def hf_init_weights(model: Any, module: nn.Module) -> None:
    """``model._init_weights(module)``: transformers' per-module initialiser (normal weights, ones for norms,
    the rotary ``inv_freq`` recomputed from the config), the one ``from_config`` applies to every module.

    Why private: transformers has no public per-module initialiser; its public ``init_weights()`` walks the
    whole model, which a rank holding one stage cannot do. The canary test builds a tiny Llama and checks
    the method exists and fills a meta-built module's rotary buffer.
    """
    model._init_weights(module)


def hf_checkpoint_conversions(model: Any) -> list[Any]:
    """The ``WeightRenaming``/``WeightConverter`` list ``from_pretrained`` applies to ``model``'s checkpoint keys
    (``[]`` for a module that is not a transformers model).

    Why undocumented: transformers documents the converters and their operations (its "Dynamic weight loading"
    page) but not ``conversion_mapping.get_model_conversion_mapping``, which gathers a model's list (per-expert
    keys merged into ``gate_up_proj`` for the MoE families); the suite's folder loader matches keys exactly as
    ``from_pretrained`` does with it.
    """
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    # transformers looks a model's list up by class name first (GPT-NeoX's ``embed_out`` -> ``lm_head``); FSDP2's
    # fully_shard swaps a module's class for ``FSDP<name>(FSDPModule, <class>)``: the lookup sees the class again.
    swapped = [(m, type(m)) for m in model.modules() if hasattr(m, "config") and _fsdp_original(type(m))]
    try:
        for module, cls in swapped:
            module.__class__ = _fsdp_original(cls)
        return list(get_model_conversion_mapping(model))
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _fsdp_original(cls: type) -> Optional[type]:
    """The class FSDP2's ``fully_shard`` derived ``cls`` from (``FSDP<name>`` with bases ``(FSDPModule, <name>)``)."""
    return next((base for base in cls.__bases__ if cls.__name__ == f"FSDP{base.__name__}"), None)


def hf_rename_checkpoint_key(
    key: str, renamings: list[Any], converters: list[Any], base_model_prefix: Optional[str], model_keys: Any
) -> tuple[str, Optional[str]]:
    """``(model key, the converter's source pattern or None)`` for a checkpoint key: every renaming, then at most
    one converter, then the base model's prefix added or taken off where ``model_keys`` says so.

    Why undocumented: ``core_model_loading.rename_source_key`` is the step of ``from_pretrained`` that does this,
    with no documented contract.
    """
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, base_model_prefix, model_keys)


@contextmanager
def hf_masks_on_meta() -> Iterator[None]:
    """Inside, transformers builds a causal mask for ``meta`` token positions without reading their values
    (lp-simulate's step on ``meta``: rows without padding and one document each).

    Why private: ``masking_utils.find_packed_sequence_indices`` reads the positions' values to tell packed documents
    apart (``.all()``), which ``meta`` tensors have none of; inside it answers "one document per row" for ``meta``
    positions, and calls the original otherwise.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: nothing to patch
        yield
        return
    original = masking_utils.find_packed_sequence_indices

    def one_document_on_meta(position_ids: Any) -> Any:
        return None if position_ids.device.type == "meta" else original(position_ids)

    masking_utils.find_packed_sequence_indices = one_document_on_meta
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
