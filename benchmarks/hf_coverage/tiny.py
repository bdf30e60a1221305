"""Every causal-LM family of the installed ``transformers`` that carries a plan, at a tiny size.

:func:`families` lists ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and sorts each model type into one of:

* ``matrix``: its config (or, for a composite, nothing else) carries ``base_model_tp_plan`` or
  ``base_model_pp_plan`` and :func:`tiny_config` builds it from its config class alone;
* ``wrapper``: a multimodal wrapper (its config's text config is another config: the causal LM
  holds a vision or audio tower), or a model whose causal-LM class has towers of its own;
* ``unbuildable``: its config class cannot be built at a tiny size, or the tiny model fails one forward
  in one process, without more than :data:`FAMILY_SETTINGS` knows (the reason is kept);
* ``no plan``: neither plan (not part of the matrix).

Sizes: 4 layers, width 32, 4 heads over 2 key/value heads of 8 (MLA models: 4 key/value heads), a vocabulary
of 128, MoE models 4 experts of width 32 with 2 per token. The documented scalars around the block chain
(embedding multipliers, logit scaling, soft-capping) are set away from 1 so that a pipeline which
dropped one would be caught by the parity run, and sliding windows are shorter than the rows.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

VOCAB = 128

SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 8,
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "embedding_dropout": 0.0, "resid_pdrop": 0.0,
    "embd_pdrop": 0.0, "attn_pdrop": 0.0, "shared_intermediate_size": 32, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_head_dim": 8,
    "linear_conv_kernel_dim": 4, "num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8, "laurel_rank": 8, "rotary_dim": 4, "chunk_size": 16,
}
MOE: dict[str, Any] = {
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "output_router_logits": False,
}
MLA: dict[str, Any] = {
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    "num_key_value_heads": 4, "index_n_heads": 4, "index_head_dim": 8, "index_topk": 8,
}
# Scalars forward applies around the blocks, away from their identity defaults.
SCALARS: dict[str, Any] = {
    "embedding_multiplier": 2.0, "logits_scaling": 4.0, "logit_scale": 0.25, "final_logit_softcapping": 3.0,
    "residual_multiplier": 0.5, "attention_multiplier": 0.2, "scale_emb": 2.0, "mup_enabled": True,
}
# What a family needs beyond the generic shape (set like the family's small released models, scaled down).
_HYBRID = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "codegen": {"n_ctx": 128},
    "minicpm3": {"dim_model_base": 8},  # logits_scaling = hidden_size / dim_model_base = 4
    "deepseek_v4": {"q_lora_rank": 16, "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 8, "index_topk": 8},
    "inkling_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "rel_extent": 16},
    "inkling2_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "rel_extent": 16,
                      "unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
                           "rel_extent": 16, "unpadded_vocab_size": VOCAB},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dory": {"n_input_layers": 1, "n_output_layers": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "nemotron_h": {"ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1,
                   "moe_shared_expert_intermediate_size": 32},
    "minimax_m3_vl_text": {"dense_intermediate_size": 64, "index_head_dim": 8, "index_block_size": 8},
    "bailing_hybrid": {"layer_types": _HYBRID},
    "kimi_linear": {"layer_types": _HYBRID},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 16},
    "gemma4_text": {"global_head_dim": 8},
    "gemma4_unified_text": {"global_head_dim": 8},
    "kolibri1_1": {"hidden_size": 64, "head_dim": 16},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1,
              "attn_layer_indices": [1, 3]},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1,
                         "mamba_chunk_size": 16, "layer_types": ["mamba", "attention", "mamba", "attention"]},
}


@dataclass(frozen=True)
class Family:
    """One causal-LM model type of the installed transformers.

    Attributes:
        model_type: the ``model_type`` (``"llama"``).
        causal_lm: the causal-LM class name ``AutoModelForCausalLM`` builds.
        kind: ``matrix``, ``wrapper``, ``unbuildable`` or ``no plan``.
        tp_plan: whether its config carries ``base_model_tp_plan``.
        pp_plan: whether its config carries ``base_model_pp_plan``.
        reason: why it is not in the matrix (``wrapper``, ``unbuildable``).
        ep_plan: whether its config carries ``base_model_ep_plan`` (experts the expert axis could shard).
    """

    model_type: str
    causal_lm: str
    kind: str
    tp_plan: bool = False
    pp_plan: bool = False
    reason: str = ""
    ep_plan: bool = False


def _transformers() -> Any:
    return importlib.import_module("transformers")


def _config_class(model_type: str) -> type:
    return _transformers().CONFIG_MAPPING[model_type]


def _settings(model_type: str, default: Any) -> dict[str, Any]:
    is_mla = hasattr(default, "kv_lora_rank")
    wanted = {**SHAPE, **MOE, **SCALARS, **(MLA if is_mla else {}), **FAMILY_SETTINGS.get(model_type, {})}
    if is_mla:
        wanted.pop("head_dim", None)  # derived from the rope/nope split
    for name in ("final_logit_softcapping",):  # only where the family has the option on (a value, not None)
        if getattr(default, name, None) is None and name not in FAMILY_SETTINGS.get(model_type, {}):
            wanted.pop(name, None)
    own = FAMILY_SETTINGS.get(model_type, {})
    return {key: value for key, value in wanted.items() if key in own or _settable(default, key)}


def _settable(config: Any, key: str) -> bool:
    """Whether the config class takes ``key`` (an attribute, not a read-only property); per-layer ones count."""
    prop = getattr(type(config), key, None)
    if isinstance(prop, property) and prop.fset is None:
        return False
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 -- transformers' per-layer attributes refuse a global read
        return True


def _no_noise(config: Any) -> None:
    """Dropout and router jitter off (``residual_dropout``, ``classifier_dropout``, ``router_jitter_noise``, ...):
    random draws differ between layouts, so with them on no layout could match one process."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and value and any(part in key for part in ("dropout", "pdrop", "jitter")):
            setattr(config, key, 0.0)


def _mix_layer_types(config: Any) -> None:
    """A window-only tiny model (Gemma 3's five local layers per global one, cut to four) gets a global layer."""
    types = getattr(config, "layer_types", None)
    if types and set(types) == {"sliding_attention"} and len(types) > 1:
        config.layer_types = [*types[:-1], "full_attention"]


def tiny_config(model_type: str) -> Any:
    """The family's config class built at the tiny size (see the module docstring).

    Raises:
        Exception: whatever the config class raises for a size it does not accept.
    """
    cls = _config_class(model_type)
    config = cls(**_settings(model_type, cls()))
    _mix_layer_types(config)
    _no_noise(config)
    return config


def _plans(config: Any) -> tuple[bool, bool]:
    """Whether a config (class or instance) carries a tensor and a pipeline plan."""
    return bool(getattr(config, "base_model_tp_plan", None)), bool(getattr(config, "base_model_pp_plan", None))


def _wrapper(config: Any) -> Optional[str]:
    try:
        text = config.get_text_config()
    except ValueError as error:  # several text configs (MusicGen): not a plain decoder
        return str(error).split(".")[0]
    if text is not config:
        return f"multimodal wrapper ({type(config).__name__} holds a {type(text).__name__})"
    towers = [name for name in ("vision_config", "audio_config") if getattr(config, name, None)]
    return f"a causal LM with its own towers ({', '.join(towers)})" if towers else None


def smoke(config: Any) -> None:
    """One forward and loss of ``AutoModelForCausalLM.from_config(config)`` on a short batch (raises if it fails)."""
    import torch

    model = _transformers().AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    if not torch.isfinite(loss):
        raise ValueError(f"the tiny model's loss is {float(loss)}")


def _reason(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:200]


def classify(model_type: str, causal_lm: str) -> Family:
    """The :class:`Family` of one model type: its plans (read from the config class), whether it is a wrapper,
    and whether its tiny config builds a model that runs one forward in one process."""
    cls = _config_class(model_type)
    tp_plan, pp_plan = _plans(cls)
    try:
        default = cls()
    except Exception as error:  # noqa: BLE001 -- a config class that cannot even be built by default
        kind = "unbuildable" if tp_plan or pp_plan else "no plan"
        return Family(model_type, causal_lm, kind, tp_plan, pp_plan, _reason(error))
    wrapper = _wrapper(default)
    if wrapper and "wrapper" in wrapper:
        text_tp, text_pp = _plans(default.get_text_config())
        tp_plan, pp_plan = tp_plan or text_tp, pp_plan or text_pp
    if not (tp_plan or pp_plan):
        return Family(model_type, causal_lm, "no plan")
    if wrapper:
        return Family(model_type, causal_lm, "wrapper", tp_plan, pp_plan, wrapper)
    try:
        smoke(tiny_config(model_type))
    except Exception as error:  # noqa: BLE001 -- the reason goes in the table
        return Family(model_type, causal_lm, "unbuildable", tp_plan, pp_plan, _reason(error))
    return Family(model_type, causal_lm, "matrix", tp_plan, pp_plan,
                  ep_plan=bool(getattr(cls, "base_model_ep_plan", None)))


def families(selected: Optional[list[str]] = None) -> list[Family]:
    """Every causal-LM model type of the installed transformers (or the ``selected`` ones), classified."""
    names = _transformers().models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    chosen = [m for m in names if selected is None or m in selected]
    unknown = sorted(set(selected or []) - set(names))
    if unknown:
        raise ValueError(f"{unknown} are not causal-LM model types of transformers {_transformers().__version__}.")
    return [classify(model_type, names[model_type]) for model_type in chosen]
