"""Pipeline stages for a Hugging Face decoder-only causal LM, from the model's own pipeline plan.

The plan (``config.base_model_pp_plan`` plus the class's ``_pp_plan``) names the blocks in forward
order under the model's own names: the embedding (the block that reads ``input_ids``), blocks on the
hidden states (GPT-NeoX's ``emb_dropout``, Phi's ``embed_dropout``), the decoder layers (the one
``ModuleList``), the final norm, then ``lm_head`` (:func:`describe_blocks`). Each becomes a pipeline
layer under its own parameter name, so checkpoint keys are the model's. What the plan leaves out,
every stage rebuilds per micro-batch as the base model's ``forward`` does:

* the 4-D attention mask per attention type (transformers' own builders: causal, sliding-window,
  chunked, and the 2-D padding mask of linear-attention layers), so eager attention stays causal;
* the position ids and the rotary ``(cos, sin)`` -- one pair per layer type when the rotary module
  takes one (Gemma 3's local and global bases);
* the steps ``forward`` applies around the blocks, read from its source (:mod:`.hf_chain`): embedding
  multipliers and dropout, logit scaling and soft-capping.

A model doing anything else around its blocks is refused before any process starts, naming the
statement or attribute (:func:`check_hf_pipeline`).

Under context parallelism each rank runs the schedule on its share of every sequence: the side inputs are
then the split batch's global position ids and its mask descriptor (:mod:`.hf_context`), which the mask
builders pass through unchanged to the run's attention function, and the targets are its ``shift_labels``.

Note:
    Only the hidden states travel between stages. The batch's ``attention_mask`` and ``position_ids``
    (the batch's, else ``0 .. seq-1`` per row, as the base model computes them) reach every stage as keyword
    side inputs that torch splits per micro-batch: every pipeline rank already holds the batch, so sending
    them would add traffic, and integer tensors have no place in the backward pass. A stage builds its masks
    and rotary positions from them, not from the hidden states it receives, which under sequence parallelism
    are its slice of the sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.adapters.hf.chain import LAYER_KEYWORDS, Chain, apply_ops, read_chain
from lightning_parallel.parallel.pipeline.stages import StageModule

SIDE_INPUTS = ("attention_mask", "position_ids")
MODEL_INPUT = "input_ids"
TARGETS = ("labels", "shift_labels")  # targets, not inputs (shift_labels: under context parallelism)
_STAGE_KEYWORDS = ("attention_mask", "position_embeddings", "position_ids", "use_cache")


def _mask_builders() -> dict[str, Any]:
    """Attention type -> transformers' mask builder (its own table where it has one)."""
    from transformers import masking_utils

    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", None) or {}
    builders = {kind: build for kind, build in table.items() if callable(build)}
    builders.setdefault("full_attention", masking_utils.create_causal_mask)
    builders.setdefault("sliding_attention", masking_utils.create_sliding_window_causal_mask)
    return builders


@dataclass(frozen=True)
class Blocks:
    """A causal LM's pipeline blocks and what its ``forward`` does around them.

    Attributes:
        roles: base-model block name -> ``embed``, ``decoder`` or ``hidden``, in forward order.
        head: the causal LM's head blocks (``lm_head``), in order.
        decoder: the name of the decoder layers' ``ModuleList``.
        chain: the steps around the blocks (:func:`~.hf_chain.read_chain`).
    """

    roles: dict[str, str]
    head: tuple[str, ...]
    decoder: str
    chain: Chain


def _remedy(cls: str) -> str:
    return (
        f"Remedy: define pipeline_layers() and pipeline_loss_terms() (or pipeline_loss()) on the LightningModule to "
        f"say how {cls} splits (see lightning_parallel/protocol.py), or train it with tensor_parallel or DeepSpeed."
    )


def _roles(model: nn.Module, base_plan: Mapping[str, Any]) -> dict[str, str]:
    cls, roles = type(model).__name__, {}
    for key, spec in base_plan.items():
        try:
            block = model.base_model.get_submodule(key)
        except AttributeError:
            raise ValueError(f"{cls}'s pipeline plan names {key!r}, which its base model does not hold. "
                             + _remedy(cls)) from None
        inputs = list(spec[0]) if isinstance(spec, (tuple, list)) and spec else []
        roles[key] = ("decoder" if isinstance(block, nn.ModuleList) else "embed" if MODEL_INPUT in inputs
                      else "hidden")
    kinds = list(roles.values())
    if kinds.count("decoder") != 1 or kinds.count("embed") != 1 or kinds[0] != "embed":
        raise ValueError(
            f"{cls}'s pipeline plan {list(base_plan)} is not one embedding (reading input_ids) first and one list of "
            "decoder layers: the suite pipelines decoder-only causal LMs laid out that way. " + _remedy(cls)
        )
    return roles


def describe_blocks(model: nn.Module) -> Blocks:
    """The blocks of ``model`` and the steps around them; raises like :func:`check_hf_pipeline`."""
    cls, config = type(model).__name__, model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{cls} is an encoder-decoder model: the suite pipelines decoder-only causal LMs from their pipeline plan. "
            + _remedy(cls)
        )
    base_plan, head_plan = getattr(config, "base_model_pp_plan", None), _compat.hf_class_plans(model)[1]
    if not base_plan or not head_plan:
        missing = "config.base_model_pp_plan" if not base_plan else f"the LM head entry of {cls}'s class pipeline plan"
        raise ValueError(f"{cls} has no pipeline plan: {missing} is missing. " + _remedy(cls))
    roles = _roles(model, base_plan)
    decoder = next(key for key, role in roles.items() if role == "decoder")
    embed = next(key for key, role in roles.items() if role == "embed")
    chain = read_chain(model, set(roles), embed, set(head_plan))
    return Blocks(roles, tuple(head_plan), decoder, chain)


def attention_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention type, chosen as the base model's forward chooses its mask.

    ``config.layer_types`` when the config has it (Qwen2, Gemma2, ...); otherwise one mask for
    every layer: sliding-window when ``config.sliding_window`` is set (Mistral), else causal.
    """
    config = model.config
    count = len(model.base_model.get_submodule(describe_blocks(model).decoder))
    if getattr(config, "layer_types", None):
        return list(config.layer_types)[:count]
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * count


def _check_chain(cls: str, blocks: Blocks) -> None:
    if blocks.chain.unknown:
        raise ValueError(
            f"{cls}'s forward does more around its pipeline blocks than the stages reproduce: "
            f"{'; '.join(repr(s) for s in blocks.chain.unknown[:3])}. " + _remedy(cls)
        )
    extra = sorted(blocks.chain.layer_keywords - LAYER_KEYWORDS)
    if extra:
        raise ValueError(
            f"{cls}'s forward passes its decoder layers {extra}, which the pipeline stages do not rebuild. "
            + _remedy(cls)
        )


def check_hf_pipeline(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the model class, the cause and the remedy, if ``model`` cannot be pipelined.

    Supported: decoder-only causal LMs whose pipeline plan names one embedding, blocks on the hidden
    states, one list of decoder layers and the LM head; whose ``forward`` applies nothing around them
    but the steps :mod:`.hf_chain` reads; and whose layers' attention types have a transformers mask builder.
    """
    cls, config = type(model).__name__, model.config
    blocks = describe_blocks(model)
    _check_chain(cls, blocks)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{cls} has use_bidirectional_attention=True: the stages build causal masks. " + _remedy(cls))
    kinds = set(attention_types(model)) - set(_mask_builders()) - set(blocks.chain.masks)
    if kinds:
        raise ValueError(
            f"{cls} has attention layers of types {sorted(kinds)} the pipeline cannot mask. " + _remedy(cls)
        )
    wants_rotary = "position_embeddings" in blocks.chain.layer_keywords or not blocks.chain.layer_keywords
    if wants_rotary and not isinstance(getattr(model.base_model, "rotary_emb", None), nn.Module):
        raise ValueError(f"{cls}'s base model has no rotary_emb to rebuild positions on each stage. " + _remedy(cls))
    held = len(model.base_model.get_submodule(blocks.decoder))
    if held != config.num_hidden_layers:
        raise ValueError(
            f"{cls} holds {held} decoder layers but config.num_hidden_layers="
            f"{config.num_hidden_layers}: its forward would skip layers. Make them agree."
        )


def hf_pipeline_layers(prefix: str, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name in the LightningModule, block, role)`` for every pipeline layer, in forward order.

    Args:
        prefix: the model's attribute path in the LightningModule (``""`` when it is one).
        model: a causal LM accepted by :func:`check_hf_pipeline`.
    """
    check_hf_pipeline(model)
    blocks = describe_blocks(model)
    base_prefix = ".".join(p for p in (prefix, model.base_model_prefix) if p)
    result = []
    for key, role in blocks.roles.items():
        block = model.base_model.get_submodule(key)
        if role == "decoder":
            result += [(f"{base_prefix}.{key}.{i}", layer, "decoder") for i, layer in enumerate(block)]
        else:
            result.append((f"{base_prefix}.{key}", block, role))
    for key in blocks.head:
        result.append((".".join(p for p in (prefix, key) if p), model.get_submodule(key), "head"))
    return result


def split_hf_inputs(inputs: Any) -> tuple[tuple, dict]:
    """``((input_ids,), side inputs)`` from a batch dict without labels (or a plain ``input_ids`` tensor)."""
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if not isinstance(inputs, Mapping) or MODEL_INPUT not in inputs:
        raise ValueError(
            f"A Hugging Face model's pipeline input must be a dict with {MODEL_INPUT!r} (got {type(inputs).__name__}"
            f"{' with keys ' + str(sorted(inputs)) if isinstance(inputs, Mapping) else ''})."
        )
    extra = sorted(set(inputs) - {MODEL_INPUT, *TARGETS, *SIDE_INPUTS})
    if extra:
        raise ValueError(
            f"Batch keys {extra} are not understood by the pipeline (it passes {MODEL_INPUT!r} and {list(SIDE_INPUTS)} "
            "to the stages): drop them from the batch, or define pipeline_split_batch(batch) on the module."
        )
    side = {k: inputs[k] for k in SIDE_INPUTS if inputs.get(k) is not None}
    if "position_ids" not in side:
        # Every stage builds its rotary positions and masks from these (the values the base model computes), not from
        # the length of the hidden states it receives: under sequence parallelism a later stage receives its slice.
        tokens = inputs[MODEL_INPUT]
        side["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    return (inputs[MODEL_INPUT],), side


def _by_layer_type(rotary: nn.Module) -> bool:
    """Whether ``rotary`` computes one ``(cos, sin)`` per layer type (``forward(x, position_ids, layer_type)``)."""
    try:
        return "layer_type" in inspect.signature(rotary.forward).parameters
    except (TypeError, ValueError):
        return False


class HFStage(StageModule):
    """The blocks of one pipeline stage of a Hugging Face causal LM, with its side inputs rebuilt per micro-batch.

    Args:
        named_layers: ``(qualified name, block)`` pairs in forward order.
        roles: each name's role: ``embed``, ``hidden``, ``decoder`` or ``head``.
        model: the Hugging Face model (its ``config``, ``rotary_emb`` and ``forward`` are read).
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]], roles: Mapping[str, str], model: nn.Module):
        super().__init__(named_layers)
        self.roles = {name: roles[name] for name, _ in named_layers}
        self.config = model.config
        blocks = describe_blocks(model)
        self.chain = blocks.chain
        given = blocks.chain.layer_keywords
        self.layer_keywords = [k for k in _STAGE_KEYWORDS if not given or k in given or k == "use_cache"]
        layer_types = attention_types(model)
        self.layer_types = {n: layer_types[int(n.rsplit(".", 1)[1])] for n, r in self.roles.items() if r == "decoder"}
        rotary = getattr(model.base_model, "rotary_emb", None)
        self.by_type = isinstance(rotary, nn.Module) and _by_layer_type(rotary)
        if self.layer_types and isinstance(rotary, nn.Module):
            self.rotary_emb = rotary  # no parameters; every stage with decoder layers needs it

    def stage_arguments(self, inputs: Any) -> tuple[tuple, dict]:
        return split_hf_inputs(inputs)

    def build_side_inputs(
        self, hidden: Tensor, attention_mask: Optional[Tensor], position_ids: Optional[Tensor]
    ) -> tuple:
        """``(masks by attention type, rotary (cos, sin) by attention type, position ids)``
        exactly as the base model's forward builds them."""
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        # Under sequence parallelism a stage after the first decoder layer receives its slice of the sequence: the
        # masks are built for the whole sequence (the builders read only the shape, dtype and device of this view).
        whole = (hidden if position_ids.shape[-1] == hidden.shape[1]
                 else hidden[:, :1].expand(hidden.shape[0], position_ids.shape[-1], *hidden.shape[2:]))
        builders, kinds = {**_mask_builders(), **self.chain.masks}, sorted(set(self.layer_types.values()))
        masks = {
            kind: builders[kind](
                config=self.config, inputs_embeds=whole, attention_mask=attention_mask, cache=None,
                position_ids=position_ids,
            )
            for kind in kinds
        }
        rotary = getattr(self, "rotary_emb", None)
        if rotary is None:
            positions = dict.fromkeys(kinds)
        elif self.by_type:
            positions = {kind: rotary(whole, position_ids, kind) for kind in kinds}
        else:
            positions = dict.fromkeys(kinds, rotary(whole, position_ids))
        if self.chain.rope_types is not None:  # layers without positional encoding (NoPE) get None
            positions = {kind: value if kind in self.chain.rope_types else None for kind, value in positions.items()}
        return masks, positions, position_ids

    def _layer(self, name: str, block: nn.Module, hidden: Tensor, side: tuple) -> Tensor:
        masks, rotary, positions = side
        kind = self.layer_types[name]
        values = {"attention_mask": masks[kind], "position_embeddings": rotary[kind], "position_ids": positions,
                  "use_cache": False}
        out = block(hidden, **{k: values[k] for k in self.layer_keywords})
        return out[0] if isinstance(out, tuple) else out

    def forward(self, hidden: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None):
        side = None
        for name in self.order:
            block, role = self.get_submodule(name), self.roles[name]
            if role == "decoder":
                side = side or self.build_side_inputs(hidden, attention_mask, position_ids)
                hidden = self._layer(name, block, hidden, side)
            elif role == "embed":
                hidden = apply_ops(self.chain.embed, block(hidden), self.training)
            elif role == "head":
                hidden = apply_ops(self.chain.after_head, block(apply_ops(self.chain.before_head, hidden,
                                                                          self.training)), self.training)
            else:
                hidden = block(hidden)
        return hidden
