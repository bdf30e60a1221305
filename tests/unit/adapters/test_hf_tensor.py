"""A Hugging Face model's own tensor-parallel plan, translated and checked before any process group (issue 15)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_parallel.adapters import adapt
from lightning_parallel.adapters.hf.styles import SumGradientsOnUse
from lightning_parallel.adapters.hf.tensor import ADAPTER_STYLES, HF_STYLES, REFUSED_STYLES, RefusedStyle
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.compose import check_module
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.tensor.plan import concrete_plan, validate_tensor_parallel
from lightning_parallel.parallel.tensor.styles import PrepareFirstInput, is_norm

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


class Holder(nn.Module):
    """A user's module: the HF model under ``self.model``, nothing else."""

    def __init__(self, family: str = "llama", **overrides) -> None:
        super().__init__()
        config = transformers.AutoConfig.for_model(family, **{**SHAPE, **overrides})
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def llama():
    return Holder("llama")


def test_plan_is_rerooted_and_mapped_to_styles_of_the_same_numerics(llama):
    plan = concrete_plan(llama, adapter=adapt(llama))
    assert type(plan["model.model.layers.1.self_attn.k_proj"]) is ColwiseParallel
    assert plan["model.model.layers.0.self_attn.q_proj"].output_layouts == (Shard(-1),)
    assert plan["model.model.layers.0.mlp.down_proj"].output_layouts == (Replicate(),)
    assert type(plan["model.model.layers.0.mlp.down_proj"]) is RowwiseParallel
    head = plan["model.lm_head"]  # colwise_gather_output: vocabulary-sharded weight, logits gathered
    assert head.output_layouts == (Replicate(),) and head.use_local_output
    embed = plan["model.model.embed_tokens"]  # embedding_rowwise: vocabulary rows sharded
    assert isinstance(embed, RowwiseParallel) and embed.input_layouts == (Replicate(),)
    assert not [name for name in plan if "norm" in name]  # norms only under sequence parallelism


def test_user_plan_and_strategy_plan_still_win(llama):
    class Own(Holder):
        def tensor_parallel_plan(self):
            return {"model.model.layers.*.mlp.up_proj": "colwise", "model.model.layers.*.mlp.down_proj": "rowwise"}

    own = Own()
    assert sorted(concrete_plan(own, adapter=adapt(own))) == [
        f"model.model.layers.{i}.mlp.{p}" for i in range(2) for p in ("down_proj", "up_proj")
    ]
    plan = concrete_plan(llama, {"model.lm_head": None, "model.model.layers.*.mlp.*_proj": None}, adapter=adapt(llama))
    assert "model.lm_head" not in plan and not [name for name in plan if ".mlp." in name]
    # transformers' own names are understood in the strategy's plan too.
    plan = concrete_plan(llama, {"model.model.layers.*.self_attn.o_proj": "rowwise_split_input"}, adapter=adapt(llama))
    assert plan["model.model.layers.1.self_attn.o_proj"].input_layouts == (Replicate(),)


def test_sequence_parallel_entries_for_a_decoder(llama):
    plan = concrete_plan(llama, sequence_parallel=True, adapter=adapt(llama))
    for norm in ("layers.0.input_layernorm", "layers.1.post_attention_layernorm", "norm"):
        style = plan[f"model.model.{norm}"]
        assert isinstance(style, SequenceParallel) and style.use_local_output  # LlamaRMSNorm, by duck type
    first = plan["model.model.layers.0"]  # the stream is sliced at the first layer, after mask and rotary
    assert isinstance(first, PrepareFirstInput) and first.desired_input_layouts == (Shard(1),)
    assert "model.model.layers.1" not in plan
    for block in ("self_attn", "mlp"):  # gathered on entry, by keyword (attention) or position (MLP)
        assert plan[f"model.model.layers.1.{block}"].input_layouts == (Shard(1),)
    assert plan["model.model.layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)  # reduce-scatter
    assert plan["model.model.embed_tokens"].output_layouts == (Replicate(),)  # the global sequence stays whole
    assert plan["model.lm_head"].input_layouts == (Shard(1),)


def test_norms_are_recognised_by_duck_type():
    class PlainRMS(nn.Module):  # no telling class name
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(4)), 1e-6

    assert is_norm(PlainRMS()) and is_norm(nn.LayerNorm(4)) and is_norm(Holder("gemma2").model.model.norm)
    assert not is_norm(nn.Linear(4, 4)) and not is_norm(nn.Embedding(4, 4))


def test_tied_embedding_and_head_are_sharded_alike():
    tied = Holder("qwen2", tie_word_embeddings=True)
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
    adapter = adapt(tied)
    validate_tensor_parallel(tied, concrete_plan(tied, adapter=adapter), 2, adapter=adapter)
    validate_tensor_parallel(tied, concrete_plan(tied, sequence_parallel=True, adapter=adapter), 2, adapter=adapter)


def test_every_transformers_style_is_mapped_or_refused():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    names = set(ALL_PARALLEL_STYLES) | {"local_colwise", "local_rowwise", "gather", "sequence_parallel"}
    known = set(HF_STYLES) | set(REFUSED_STYLES) | set(ADAPTER_STYLES)
    assert names <= known, names - known


def _resolve(module, overrides=None, **options):
    """``concrete_plan`` with the adapter a strategy would resolve once for ``module``."""
    return concrete_plan(module, overrides, **options, adapter=adapt(module))


def _with_packed_gate():
    holder = Holder("llama")
    holder.model.tp_plan = {**holder.model.tp_plan, "model.layers.*.mlp.gate_proj": "packed_colwise"}
    return holder


def _untied_by_plan():
    tied = Holder("qwen2", tie_word_embeddings=True)
    validate_tensor_parallel(tied, _resolve(tied, {"model.model.embed_tokens": None}), 2, adapter=adapt(tied))


def _sequence_parallel_with_unplanned_mlp():
    _resolve(Holder("llama"), {"model.model.layers.*.mlp.*_proj": None}, sequence_parallel=True)


def _no_plan_at_all():
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    validate_tensor_parallel(module, concrete_plan(module, adapter=adapt(module)), 2, adapter=adapt(module))


def _hf_model_without_a_plan():
    holder = nn.Module()
    with torch.device("meta"):
        holder.model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128)
        )
    validate_tensor_parallel(holder, concrete_plan(holder, adapter=adapt(holder)), 2, adapter=adapt(holder))


def _check_module(module, tensor_parallel, **options):
    layout = ParallelLayout.resolve(tensor_parallel, data_parallel=1, tensor_parallel=tensor_parallel)
    return check_module(
        module, layout, ParallelOptions(data_parallel_size=1, tensor_parallel_size=tensor_parallel, **options)
    )


# (what goes wrong, the call, what the message must say): each a ValueError before any process group.
ERRORS = [
    ("refused transformers style", lambda: _resolve(_with_packed_gate()),
     r"LlamaForCausalLM's tensor-parallel plan gives 'model\.model\.layers\.0\.mlp\.gate_proj' the transformers "
     r"style 'packed_colwise', which the suite cannot run: fused projections .*plan=\{'model\.model\.layers\.0"),
    ("unknown style name", lambda: _resolve(Holder("llama"), {"model.lm_head": "columnwise_gather"}),
     r"'model\.lm_head' has style 'columnwise_gather': use one of colwise, rowwise"),
    ("tensor size 4 over 2 key/value heads", lambda: _check_module(Holder("llama"), 4),
     r"tensor_parallel_size=4 does not divide.*LlamaConfig has num_key_value_heads=2.*divide every sharded "
     r"dimension: 1, 2\."),
    ("tensor size 3 over 4 heads", lambda: _check_module(Holder("mistral"), 3),
     r"MistralConfig has num_attention_heads=4 \(attention heads\).*: 1, 2\."),
    ("nothing to shard", _no_plan_at_all,
     r"tensor_parallel_size=2, but .* Sequential is empty: nothing would be sharded"),
    ("HF model without a plan", _hf_model_without_a_plan,
     r"GPT2LMHeadModel, whose config has no base_model_tp_plan.*plan=\{\.\.\.\}.*tensor_parallel_size=1"),
    ("plan that unties a tied weight", _untied_by_plan,
     r"model\.model\.embed_tokens\.weight and model\.lm_head\.weight are one tied parameter.*train apart"),
    ("sequence parallel over an unplanned block", _sequence_parallel_with_unplanned_mlp,
     r"'model\.model\.layers\.0\.mlp' has 'gather_input' but no column-sharded"),
    ("sequence parallel on a model laid out otherwise",
     lambda: _check_module(_gemma_without_norm(), 2, sequence_parallel=True),
     r"sequence_parallel=True with Gemma2ForCausalLM: .*embed_tokens / layers / norm"),
]


def _gemma_without_norm():
    holder = Holder("gemma2")
    holder.model.model.norm = nn.Identity()
    return holder


@pytest.mark.parametrize(("case", "call", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_fix_before_any_process_group(case, call, message):
    with pytest.raises(ValueError, match=message):
        call()
    assert not dist.is_initialized()


def test_refused_style_is_lifted_by_a_plan_override():
    holder = _with_packed_gate()
    assert isinstance(adapt(holder).tensor_plan()[1]["model.model.layers.*.mlp.gate_proj"], RefusedStyle)
    plan = concrete_plan(holder, {"model.model.layers.*.mlp.gate_proj": "colwise"}, adapter=adapt(holder))
    assert type(plan["model.model.layers.0.mlp.gate_proj"]) is ColwiseParallel


def test_per_head_norms_sum_their_gradients():
    plan = _resolve(Holder("qwen3"))  # q_norm/k_norm: transformers' replicated_with_grad_allreduce
    # Hooked when the norm runs, on the parameter objects it then holds (a meta build gets new ones).
    assert isinstance(plan["model.model.layers.0.self_attn.q_norm"], SumGradientsOnUse)
    assert type(plan["model.model.layers.0.self_attn.q_proj"]) is ColwiseParallel


def test_plan_built_from_class_and_config_when_the_instance_has_none():
    # As transformers < 5 models: no merged instance plan and no embedding entry in base_model_tp_plan.
    tied = Holder("qwen2", tie_word_embeddings=True)
    tied.model._tp_plan = {}
    _, plan = adapt(tied).tensor_plan()
    assert plan["model.lm_head"] == "colwise_gather" and plan["model.model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["model.model.embed_tokens"] == "embedding_rowwise"  # added: the tied head must not be sharded alone
    validate_tensor_parallel(tied, concrete_plan(tied, adapter=adapt(tied)), 2, adapter=adapt(tied))


def test_a_config_tie_the_weights_no_longer_keep_is_detected():
    tied = Holder("qwen2", tie_word_embeddings=True)
    assert adapt(tied).untied_embeddings() is None and adapt(Holder("llama")).untied_embeddings() is None
    tied.model.lm_head.weight = nn.Parameter(torch.empty(128, 32, device="meta"))  # what to_empty or sharding does
    assert "Qwen2ForCausalLM has tie_word_embeddings=True" in adapt(tied).untied_embeddings()
