"""Which Linear layers train in FP8 (``float8``) and which stay in high precision, on the GPT recipe and on a Hugging
Face Llama and Qwen2-MoE built from tiny configs: decided by the adapter's names and the shapes (no torchao needed)."""

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.float8.choice import Float8Choice, choose_float8_layers

PROJECTIONS = ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.up", "mlp.down")


def _gpt(**overrides):
    from tests.distributed.parity_runs import tiny_gpt

    return tiny_gpt(**overrides).build()


def test_gpt_blocks_compute_in_fp8_and_the_head_stays_in_high_precision():
    model = _gpt()
    converted, kept = choose_float8_layers(model, adapt(model))
    assert converted == tuple(f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS)
    assert kept == {"head.proj": "output head"}


def test_gpt_moe_router_stays_in_high_precision_and_grouped_experts_are_not_linear_layers():
    model = _gpt(moe={"every": 2, "num_experts": 4, "top_k": 2})
    converted, kept = choose_float8_layers(model, adapt(model))
    assert kept == {"blocks.1.mlp.router": "MoE router", "head.proj": "output head"}
    assert "blocks.1.mlp.up" not in converted and not any("experts" in name for name in converted)
    assert converted == tuple([f"blocks.0.{p}" for p in PROJECTIONS] + [f"blocks.1.{p}" for p in PROJECTIONS[:4]])


def test_dimensions_not_divisible_by_16_stay_in_high_precision_with_the_reason():
    model = _gpt(d_model=24, n_head=4)  # q/k/v/out are 24 x 24; the MLP is 24 x 96
    converted, kept = choose_float8_layers(model, adapt(model))
    assert kept["blocks.0.attn.q"] == "24x24 not divisible by 16"
    assert kept["blocks.1.mlp.up"] == "24x96 not divisible by 16"
    assert converted == ()


def test_tensor_parallel_shards_are_checked_as_each_rank_computes_them():
    model = _gpt()  # q is 32 -> 32: column-sharded 4 ways each rank computes 32 -> 8
    plan = {"blocks.0.attn.q": ColwiseParallel(), "blocks.0.attn.out": RowwiseParallel()}
    converted, kept = choose_float8_layers(model, adapt(model), tensor_size=4, sharded=plan)
    assert kept["blocks.0.attn.q"] == "32x8 per tensor rank not divisible by 16"
    assert kept["blocks.0.attn.out"] == "8x32 per tensor rank not divisible by 16"
    assert "blocks.1.attn.q" in converted  # not in this plan: whole on every rank


def test_a_module_names_its_own_high_precision_layers():
    model = _gpt()
    model.float8_high_precision = lambda: {"blocks.0.*": "first block, by choice"}
    converted, kept = choose_float8_layers(model, adapt(model))
    assert set(kept) == {f"blocks.0.{p}" for p in PROJECTIONS} and "head.proj" in converted


def test_hugging_face_llama_keeps_lm_head_and_converts_every_projection():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    converted, kept = choose_float8_layers(model, adapt(model))
    assert kept == {"lm_head": "output head"}
    assert len(converted) == 14 and all(name.startswith("model.layers.") for name in converted)


def test_hugging_face_moe_router_and_shared_expert_gate_stay_in_high_precision():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen2MoeForCausalLM(config)
    adapter = adapt(model)
    named = adapter.high_precision_layers()
    assert named["model.layers.0.mlp.gate"] == "MoE router" and named["lm_head"] == "output head"
    converted, kept = choose_float8_layers(model, adapter)
    # The router is transformers' own module (not a Linear): it is never converted; the shared expert's gate is one.
    assert kept == {"model.layers.0.mlp.shared_expert_gate": "MoE router",
                    "model.layers.1.mlp.shared_expert_gate": "MoE router", "lm_head": "output head"}
    assert "model.layers.0.mlp.shared_expert.up_proj" in converted


def test_the_start_up_notice_lists_every_kept_layer_once_per_pattern():
    kept = {f"blocks.{i}.mlp.router": "MoE router" for i in range(1, 8, 2)} | {"head.proj": "output head"}
    notice = Float8Choice("tensorwise", ("a", "b"), kept, all_gather=True, emulated=True).notice("0.18.0")
    assert notice.startswith("lightning_parallel: float8 tensorwise (torchao 0.18.0, emulated")
    assert "FP8 all-gather under FSDP2" in notice and "2 Linear layers in FP8" in notice
    assert "blocks.*.mlp.router x4 (MoE router); head.proj (output head)" in notice
    assert "\n" not in notice
