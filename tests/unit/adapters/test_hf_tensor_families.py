"""Tensor plans of the Hugging Face families the coverage matrix found gaps in (issue 29), checked in one process.

* ``loss_parallel=True`` keeps only the LM head's logits vocabulary-sharded: Phi-3's fused ``qkv_proj`` and
  ``gate_up_proj`` and OLMo2's q/k/v (all ``colwise_gather_output``) stay gathered, or their split outputs would
  meet plain tensors inside the forward ("mixed torch.Tensor and DTensor" on every rank).
* A pattern of the model's own plan that names no submodule is passed over, as transformers passes over it
  (a dense-MLP entry in a model whose layers are all experts).
* Multi-head latent attention's ``mla_kv_a_proj`` runs (DeepSeek-V3), and head counts are checked on its
  column-sharded ``q_b_proj`` / ``kv_b_proj``.
* Parameters computing on a column-sharded projection's output that the plan forgets (Apertus's xIELU
  ``act_fn``) sum their gradients; those on a gathered output (OLMo2's ``q_norm``) do not.
* A module whose tensors ``_init_weights`` leaves unset gets its constructor's values when built on meta.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_parallel.adapters import adapt
from lightning_parallel.adapters.hf.styles import MlaKvAProj, SumGradientsOnUse
from lightning_parallel.parallel.tensor.plan import loss_head, concrete_plan, validate_tensor_parallel

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)


class Holder(nn.Module):
    def __init__(self, family: str, **overrides) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(family, **{**SHAPE, **overrides})
        self.model = transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("family", "fused"), [("phi3", ("self_attn.qkv_proj", "mlp.gate_up_proj")),
                                               ("olmo2", ("self_attn.q_proj", "self_attn.k_proj"))])
def test_loss_parallel_shards_only_the_lm_head_logits(family, fused):
    holder = Holder(family, tie_word_embeddings=False)
    plan = concrete_plan(holder, loss_parallel=True, adapter=adapt(holder))
    head = plan["model.lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    for name in fused:
        style = plan[f"model.model.layers.0.{name}"]
        assert style.output_layouts == (Replicate(),) and style.use_local_output, name
    assert plan["model.model.layers.1." + fused[0]].output_layouts == (Replicate(),)


def test_the_loss_head_is_the_last_gathered_entry_outside_the_blocks():
    plan = {"blocks.0.qkv": "colwise_gather", "blocks.1.qkv": "colwise_gather", "head.proj": "colwise_gather",
            "blocks.0.out": "rowwise"}
    assert loss_head(plan) == "head.proj"
    assert loss_head({"blocks.0.qkv": "colwise_gather"}) is None  # nothing to keep sharded: all stay gathered


def test_plan_patterns_naming_no_submodule_are_passed_over():
    holder = Holder("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16)
    _, plan = adapt(holder).tensor_plan()
    assert "model.layers.*.mlp.gate_proj" in holder.model.tp_plan  # transformers' plan names a dense MLP ...
    assert "model.model.layers.*.mlp.gate_proj" not in plan  # ... that no layer holds: every layer is sparse
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise"
    adapter = adapt(holder)
    validate_tensor_parallel(holder, concrete_plan(holder, adapter=adapter), 2, adapter=adapter)


def test_multi_head_latent_attention_projection_runs_and_its_heads_are_checked():
    holder = Holder("deepseek_v3", num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                    qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=16, first_k_dense_replace=2, n_group=1, topk_group=1, head_dim=None)
    plan = concrete_plan(holder, adapter=adapt(holder))
    assert plan["model.model.layers.0.self_attn.kv_a_proj_with_mqa"] == MlaKvAProj(4)
    dims = adapt(holder).head_dimensions(plan)
    assert ("DeepseekV3Config has num_attention_heads=4 (attention heads)", 4) in dims
    with pytest.raises(ValueError, match=r"num_attention_heads=4.*Sizes that divide every sharded dimension: 1, 2, 4"):
        validate_tensor_parallel(holder, plan, 8, adapter=adapt(holder))


def test_parameters_on_sharded_features_sum_their_gradients_and_on_gathered_ones_do_not():
    apertus = Holder("apertus", hidden_act="xielu")
    plan = concrete_plan(apertus, adapter=adapt(apertus))
    assert isinstance(plan["model.model.layers.0.mlp.act_fn"], SumGradientsOnUse)
    olmo2_holder = Holder("olmo2")
    olmo2 = concrete_plan(olmo2_holder, adapter=adapt(olmo2_holder))
    assert "model.model.layers.0.self_attn.q_norm" not in olmo2  # its q_proj output is gathered: whole gradients


def test_constructor_set_tensors_are_initialised_on_meta_as_from_config_sets_them():
    reference = Holder("apertus", hidden_act="xielu")
    with torch.device("meta"):
        holder = Holder("apertus", hidden_act="xielu")
    act = holder.model.model.layers[0].mlp.act_fn
    act.to_empty(device="cpu")
    with torch.no_grad():
        act.alpha_p.fill_(1e30)  # what uninitialised memory may hold
    adapt(holder).init_module("model.model.layers.0.mlp.act_fn", act)
    expected = reference.model.model.layers[0].mlp.act_fn
    assert torch.equal(act.alpha_p, expected.alpha_p) and torch.equal(act.alpha_n, expected.alpha_n)
    assert torch.equal(act.beta, expected.beta)


def test_tensors_an_ancestor_initialises_are_initialised_on_meta_as_from_config_sets_them():
    """Qwen3-Next's router weight is drawn by its sparse MoE block's branch of ``_init_weights``, not its own."""
    overrides = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    with torch.device("meta"):
        holder = Holder("qwen3_next", **overrides)
    name = "model.model.layers.0.mlp.gate"
    router = holder.get_submodule(name)
    router.to_empty(device="cpu")
    with torch.no_grad():
        router.weight.fill_(float("nan"))
    torch.manual_seed(0)
    adapt(holder).init_module(name, router)
    torch.manual_seed(0)
    expected = torch.empty_like(router.weight).normal_(0.0, holder.model.config.initializer_range)
    assert torch.equal(router.weight, expected)  # the parent's draw, not the constructor's zeros


def test_a_per_head_parameter_the_plan_leaves_whole_is_refused_before_start():
    """Doge's attention holds ``A``, one entry per key/value head, beside its column-sharded projections."""
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.parallel.compose import check_module
    from lightning_parallel.parallel.options import ParallelOptions

    holder = Holder("doge")
    refusal = r"DogeAttention holds \['A'\], one entry per head.*Replace or remove the entry"
    with pytest.raises(ValueError, match=refusal):
        check_module(holder, ParallelLayout(2, 1, 1, 2), ParallelOptions(1, 1, 2))
    # The user's plan= may lift it.
    plan = concrete_plan(holder, {"model.model.layers.*.self_attn": None}, adapter=adapt(holder))
    assert "model.model.layers.0.self_attn" not in plan
