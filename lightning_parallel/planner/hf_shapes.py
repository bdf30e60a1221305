"""Analytic shapes from a Hugging Face decoder's config values (dense or mixture-of-experts), for plans at a scale
this machine cannot instantiate (``lp-plan --shape mixtral-8x7b`` or ``--shape path/to/config.json``).

Read from the config: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``; experts from ``num_local_experts``
(Mixtral, Qwen3-MoE) or ``num_experts`` (OLMoE, Qwen2-MoE), ``num_experts_per_tok``, ``moe_intermediate_size``
(else ``intermediate_size``) and ``shared_expert_intermediate_size``; which layers are MoE from
``mlp_only_layers``, ``decoder_sparse_step`` (Qwen) and ``first_k_dense_replace`` / ``moe_layer_freq`` (DeepSeek).

Note:
    Attention is modelled as grouped-query attention with flash attention (DeepSeek's MLA is not), experts as
    SwiGLU MLPs stored grouped (``gate_up_proj [E, 2h, d]``, ``down_proj [E, d, h]``, as transformers 5 holds
    them). As in the suite's GPT recipe, an MoE block keeps its router, experts and shared expert whole on every
    tensor rank: tensor parallelism shards the attention only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_parallel.planner.shapes import AttentionShape, ExpertShape, LayerShape, ModelShape, Param, _block

MOE_CONFIGS: dict[str, dict[str, Any]] = {
    # The published config.json values that decide the shape.
    "mixtral-8x7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe-1b-7b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "intermediate_size": 1024, "vocab_size": 50304, "num_experts": 64,
                    "num_experts_per_tok": 8},
    "qwen3-30b-a3b": {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "vocab_size": 151936, "num_experts": 128,
                      "num_experts_per_tok": 8},
}


def moe_layers(config: Mapping[str, Any]) -> list[int]:
    """Indices of the decoder layers whose MLP is a mixture of experts (none without an expert count).

    Args:
        config: the config's values.
    """
    if not (config.get("num_local_experts") or config.get("num_experts")):
        return []
    layers = int(config["num_hidden_layers"])
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first and i % freq == 0]


def _moe_block(i: int, c: Mapping[str, Any], experts: ExpertShape, shared: int, s: int, act: int) -> LayerShape:
    """One decoder block with GQA attention and ``E`` SwiGLU experts (plus a shared expert of width ``shared``)."""
    h, heads = experts.d_model, int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or h // heads)
    q, kv, e, ffn = heads * head_dim, kv_heads * head_dim, experts.num_experts, experts.hidden
    attention = (Param((h,)), Param((q, h), 0), Param((kv, h), 0), Param((kv, h), 0), Param((h, q), 1), Param((h,)))
    moe = (Param((e, h)), Param((e, 2 * ffn, h), expert=True), Param((e, h, ffn), expert=True))
    dense = (Param((shared, h)), Param((shared, h)), Param((h, shared))) if shared else ()
    matmul = sum(p.numel for p in attention if len(p.shape) == 2)
    flops = (2 * matmul * s + 4 * s * s * q + 2 * s * e * h + 2 * s * experts.top_k * experts.expert_params
             + 2 * s * 3 * h * shared)
    # Saved for backward: q, k, v and the attention output (sharded by tensor parallelism); the norm inputs, the
    # attention and MoE inputs, fp32 router logits, and per token copy its input, SwiGLU's four ffn-wide tensors and
    # its output (replicated: the MoE block is whole on every tensor rank); the shared expert's four tensors.
    sharded = act * s * (2 * q + 2 * kv)
    replicated = act * s * 4 * h + 4 * s * e + act * s * (experts.top_k * (2 * h + 4 * ffn) + 4 * shared)
    # Selective keeps the matmul and attention outputs (as for a dense block): the norm inputs, q, k, v, the
    # attention output, the router logits, and per copy its input, the gate and up outputs and its output.
    kept = act * s * (2 * h + 2 * q + 2 * kv) + 4 * s * e + act * s * (experts.top_k * (2 * h + 2 * ffn) + 2 * shared)
    return LayerShape(f"layers.{i}", attention + moe + dense, fwd_flops=float(flops), activation_sharded=sharded,
                      activation_replicated=replicated, output_bytes=act * s * h, tp_all_reduce_bytes=act * s * h,
                      tp_collectives=2, recompute_fraction=0.05, selective_saved=kept / (sharded + replicated),
                      attention_modules=1, moe_modules=1)


def config_shape(config: Mapping[str, Any], name: str, seq_len: int = 4096, act_bytes: int = 2) -> ModelShape:
    """A decoder from its Hugging Face config values (module docstring), bf16 activations by default.

    Args:
        config: ``config.json``'s values.
        name: what to call it in tables.
        seq_len: tokens per sample.
        act_bytes: bytes per activation element.
    """
    c, s = config, seq_len
    h, n, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    sparse = set(moe_layers(c))
    experts = None
    if sparse:
        ffn = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        experts = ExpertShape(int(c.get("num_local_experts") or c["num_experts"]), int(c["num_experts_per_tok"]),
                              h, ffn, s, 3 * h * ffn, act_bytes)
    shared = int(c.get("shared_expert_intermediate_size") or 0)
    blocks = tuple(_moe_block(i, c, experts, shared, s, act_bytes) if i in sparse
                   else _block(i, h, heads, kv_heads, int(c["intermediate_size"]), s, act_bytes) for i in range(n))
    embed = LayerShape("embed_tokens", (Param((vocab, h), 0),), fwd_flops=0.0, activation_sharded=0.0,
                       activation_replicated=0.0, output_bytes=act_bytes * s * h, tp_all_reduce_bytes=act_bytes * s * h)
    head = LayerShape("norm+lm_head", (Param((h,)), Param((vocab, h), 0)), fwd_flops=2 * vocab * h * s,
                      activation_sharded=4 * s * vocab, activation_replicated=act_bytes * s * 2 * h,
                      output_bytes=4 * s * vocab)
    head_dim = int(c.get("head_dim") or h // heads)
    divides = (("query heads", heads), ("kv heads", kv_heads), ("vocabulary", vocab))
    if len(sparse) < n:
        divides += (("ffn hidden", int(c["intermediate_size"])),)
    return ModelShape(name, (embed, *blocks, head), tp_divides=divides,
                      source=f"analytic from config values (seq {s}, {8 * act_bytes}-bit activations)",
                      attention=AttentionShape(s, heads, kv_heads, head_dim, act_bytes), experts=experts)


def named_shape(name_or_path: str, seq_len: int = 4096, act_bytes: int = 2) -> ModelShape:
    """A published MoE decoder (:data:`MOE_CONFIGS`) or a Hugging Face ``config.json`` file, as a shape.

    Args:
        name_or_path: a key of :data:`MOE_CONFIGS`, or the path of a ``config.json``.
        seq_len: tokens per sample.
        act_bytes: bytes per activation element.
    """
    if name_or_path in MOE_CONFIGS:
        return config_shape(MOE_CONFIGS[name_or_path], name_or_path, seq_len, act_bytes)
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(f"Unknown shape {name_or_path!r}: use one of {sorted(MOE_CONFIGS)} or a config.json path.")
    config = json.loads(path.read_text())
    return config_shape(config.get("text_config") or config, path.parent.name or path.stem, seq_len, act_bytes)
