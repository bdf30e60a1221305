"""Pipeline stages for a Hugging Face decoder-only causal LM, from the model's own pipeline plan.

The plan (``config.base_model_pp_plan`` plus the class's ``_pp_plan``) names the blocks in
order: ``embed_tokens``, ``layers`` (the decoder layers), ``norm``, then ``lm_head``. Each
becomes a pipeline layer under its own parameter name, so checkpoint keys are the
model's. What the plan leaves out is what every decoder layer also needs: the 4-D
attention mask (causal + padding, per attention type), the position ids and the rotary
``(cos, sin)``. A :class:`HFStage` rebuilds them on every stage for every micro-batch, the
way ``LlamaModel.forward`` does (transformers' own ``create_causal_mask`` /
``create_sliding_window_causal_mask`` and the model's ``rotary_emb``), so eager and sdpa
attention stay causal and masks follow the micro-batch split.

Under context parallelism each rank runs the schedule on its share of every sequence: the side inputs are
then the split batch's global position ids and its mask descriptor (:mod:`.hf_context`), which the mask
builders pass through unchanged to the run's attention function, and the targets are its ``shift_labels``.

Note:
    Only the hidden states travel between stages. The batch's ``attention_mask`` (and
    ``position_ids`` when the batch has them) reach every stage as keyword side inputs that
    torch splits per micro-batch: every pipeline rank already holds the batch, so sending
    them would add traffic, and integer tensors have no place in the backward pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.parallel.pipeline.stages import StageModule

BASE_ROLES = {"embed_tokens": "embed", "layers": "decoder", "norm": "norm"}
HEAD_ROLES = {"lm_head": "head"}
SIDE_INPUTS = ("attention_mask", "position_ids")
MODEL_INPUT = "input_ids"
TARGETS = ("labels", "shift_labels")  # targets, not inputs (shift_labels: under context parallelism)


def _mask_builders() -> dict[str, Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    return {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def attention_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention type, chosen as the base model's forward chooses its mask.

    ``config.layer_types`` when the config has it (Qwen2, Gemma2, ...); otherwise one mask for
    every layer: sliding-window when ``config.sliding_window`` is set (Mistral), else causal.
    """
    config = model.config
    count = len(model.base_model.layers)
    if getattr(config, "layer_types", None):
        return list(config.layer_types)[:count]
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * count


def _remedy(cls: str) -> str:
    return (
        f"Remedy: define pipeline_layers() and pipeline_loss_terms() (or pipeline_loss()) on the LightningModule to "
        f"say how {cls} splits (see lightning_parallel/protocol.py), or train it with tensor_parallel or DeepSpeed."
    )


def check_hf_pipeline(model: nn.Module) -> None:
    """Raise a ``ValueError`` naming the model class, what is missing and the remedy, if ``model`` cannot be pipelined.

    Supported: decoder-only causal LMs whose config carries ``base_model_pp_plan`` with the
    keys ``embed_tokens``/``layers``/``norm``, whose class ``_pp_plan`` is ``lm_head``, and
    whose layers are full or sliding-window attention with a ``rotary_emb``.
    """
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
    unknown = sorted((set(base_plan) - set(BASE_ROLES)) | (set(head_plan) - set(HEAD_ROLES)))
    if unknown or set(base_plan) != set(BASE_ROLES):
        raise ValueError(
            f"{cls}'s pipeline plan has blocks {sorted(base_plan) + sorted(head_plan)}; the suite understands exactly "
            f"{sorted(BASE_ROLES)} + {sorted(HEAD_ROLES)} (unsupported: {unknown or 'a missing block'}). "
            + _remedy(cls)
        )
    kinds = set(attention_types(model)) - set(_mask_builders())
    if kinds:
        raise ValueError(
            f"{cls} has attention layers of types {sorted(kinds)} the pipeline cannot mask. " + _remedy(cls)
        )
    if not isinstance(getattr(model.base_model, "rotary_emb", None), nn.Module):
        raise ValueError(f"{cls}'s base model has no rotary_emb to rebuild positions on each stage. " + _remedy(cls))
    if len(model.base_model.layers) != config.num_hidden_layers:
        raise ValueError(
            f"{cls} holds {len(model.base_model.layers)} decoder layers but config.num_hidden_layers="
            f"{config.num_hidden_layers}: its forward would skip layers. Make them agree."
        )


def hf_pipeline_layers(prefix: str, model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name in the LightningModule, block, role)`` for every pipeline layer, in forward order.

    Args:
        prefix: the model's attribute path in the LightningModule (``""`` when it is one).
        model: a causal LM accepted by :func:`check_hf_pipeline`.
    """
    check_hf_pipeline(model)
    base_prefix = ".".join(p for p in (prefix, model.base_model_prefix) if p)
    head_prefix = prefix
    result = []
    for key in model.config.base_model_pp_plan:
        block = model.base_model.get_submodule(key)
        if BASE_ROLES[key] == "decoder":
            result += [(f"{base_prefix}.{key}.{i}", layer, "decoder") for i, layer in enumerate(block)]
        else:
            result.append((f"{base_prefix}.{key}", block, BASE_ROLES[key]))
    for key in _compat.hf_class_plans(model)[1]:
        result.append((".".join(p for p in (head_prefix, key) if p), model.get_submodule(key), HEAD_ROLES[key]))
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
    return (inputs[MODEL_INPUT],), {k: inputs[k] for k in SIDE_INPUTS if inputs.get(k) is not None}


class HFStage(StageModule):
    """The blocks of one pipeline stage of a Hugging Face causal LM, with its side inputs rebuilt per micro-batch.

    Args:
        named_layers: ``(qualified name, block)`` pairs in forward order.
        roles: each name's role: ``embed``, ``decoder``, ``norm`` or ``head``.
        model: the Hugging Face model (its ``config`` and ``rotary_emb`` are used).
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]], roles: Mapping[str, str], model: nn.Module):
        super().__init__(named_layers)
        self.roles = {name: roles[name] for name, _ in named_layers}
        self.config = model.config
        layer_types = attention_types(model)
        self.layer_types = {n: layer_types[int(n.rsplit(".", 1)[1])] for n, r in self.roles.items() if r == "decoder"}
        if self.layer_types:
            self.rotary_emb = model.base_model.rotary_emb  # no parameters; every stage with decoder layers needs it

    def stage_arguments(self, inputs: Any) -> tuple[tuple, dict]:
        return split_hf_inputs(inputs)

    def build_side_inputs(
        self, hidden: Tensor, attention_mask: Optional[Tensor], position_ids: Optional[Tensor]
    ) -> tuple:
        """``(masks by attention type, rotary (cos, sin), position ids)``
        exactly as the base model's forward builds them."""
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        builders = _mask_builders()
        masks = {
            kind: builders[kind](
                config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
                position_ids=position_ids,
            )
            for kind in sorted(set(self.layer_types.values()))
        }
        return masks, self.rotary_emb(hidden, position_ids), position_ids

    def forward(self, hidden: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None):
        side = None
        for name in self.order:
            block = self.get_submodule(name)
            if self.roles[name] != "decoder":
                hidden = block(hidden)
                continue
            if side is None:
                side = self.build_side_inputs(hidden, attention_mask, position_ids)
            masks, rotary, positions = side
            out = block(
                hidden, attention_mask=masks[self.layer_types[name]], position_embeddings=rotary,
                position_ids=positions, use_cache=False,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden
