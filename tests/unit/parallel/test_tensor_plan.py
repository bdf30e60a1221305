"""Plan resolution and size validation for tensor parallelism (no processes)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from examples.nlp.model import GPT
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.tensor.plan import (
    STYLE_NAMES,
    loss_parallel_context,
    concrete_plan,
    validate_tensor_parallel,
)
from lightning_parallel.testing.models import ResidualMLP


@pytest.fixture(scope="module")
def gpt():
    with torch.device("meta"):
        return GPT(d_model=32, n_layer=2, n_head=4, seq_len=16).build()


def test_style_names():
    for name in ("colwise", "rowwise", "embedding_rowwise", "colwise_gather", "sequence", "gather_input"):
        assert name in STYLE_NAMES


def test_gpt_plan_expands_globs_in_module_order(gpt):
    plan = concrete_plan(gpt, adapter=adapt(gpt))
    per_block = ["attn", "attn.q", "attn.k", "attn.v", "attn.out", "mlp", "mlp.up", "mlp.down"]
    assert list(plan) == ["embed.tok"] + [f"blocks.{i}.{n}" for i in range(2) for n in per_block] + ["head.proj"]
    assert type(plan["blocks.1.attn.q"]) is ColwiseParallel
    assert type(plan["blocks.0.mlp.down"]) is RowwiseParallel
    assert plan["blocks.0.mlp.down"].output_layouts == (Replicate(),)
    head = plan["head.proj"]
    assert head.output_layouts == (Replicate(),) and head.use_local_output
    # Without sequence parallelism gather_input only marks the replicated input once.
    assert plan["blocks.0.attn"].input_layouts == (Replicate(),)


def test_sequence_parallel_adds_norms_and_shards_the_stream(gpt):
    plan = concrete_plan(gpt, sequence_parallel=True, adapter=adapt(gpt))
    for name in ("blocks.0.ln1", "blocks.1.ln2", "head.norm"):
        assert isinstance(plan[name], SequenceParallel)
    assert plan["blocks.0.attn.out"].output_layouts == (Shard(1),)
    assert plan["blocks.0.attn"].input_layouts == (Shard(1),)
    assert plan["blocks.0.attn"].desired_input_layouts == (Replicate(),)
    assert plan["head.proj"].input_layouts == (Shard(1),)
    # The token embedding stays replicated (positions are added first); embed slices the sum.
    assert plan["embed.tok"].output_layouts == (Replicate(),)
    assert isinstance(plan["embed"], PrepareModuleOutput) and plan["embed"].desired_output_layouts == (Shard(1),)
    assert list(plan).index("embed") < list(plan).index("embed.tok") < list(plan).index("blocks.0.ln1")


def test_loss_parallel_keeps_logits_vocab_sharded(gpt):
    head = concrete_plan(gpt, loss_parallel=True, adapter=adapt(gpt))["head.proj"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output


def test_embedding_rowwise_goes_to_the_sequence_shard_under_sequence_parallel():
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8))
    plain = concrete_plan(model, {"0": "embedding_rowwise"}, adapter=adapt(model))["0"]
    sharded = concrete_plan(model, {"0": "embedding_rowwise"}, sequence_parallel=True, adapter=adapt(model))["0"]
    assert plain.input_layouts == (Replicate(),) and plain.output_layouts == (Replicate(),)
    assert sharded.output_layouts == (Shard(1),)


def test_overrides_win_add_and_remove(gpt):
    custom = RowwiseParallel(output_layouts=Replicate(), use_local_output=False)
    plan = concrete_plan(
        gpt,
        {"blocks.0.mlp.down": custom, "head.proj": None, "blocks.*.attn.[qkv]": "colwise", "embed.pos": "colwise"},
        adapter=adapt(gpt),
    )
    assert plan["blocks.0.mlp.down"] is custom
    assert type(plan["blocks.1.mlp.down"]) is RowwiseParallel and plan["blocks.1.mlp.down"] is not custom
    assert "head.proj" not in plan
    assert type(plan["embed.pos"]) is ColwiseParallel
    # Removing with a glob removes every match.
    plan = concrete_plan(gpt, {"blocks.*.mlp*": None}, adapter=adapt(gpt))
    assert not [name for name in plan if ".mlp" in name]


def test_module_without_own_plan_takes_overrides_only():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert concrete_plan(model, adapter=adapt(model)) == {}
    plan = concrete_plan(model, {"0": "colwise", "2": "rowwise"}, adapter=adapt(model))
    assert list(plan) == ["0", "2"]


def test_residual_mlp_plan_resolves():
    model = ResidualMLP(width=8, depth=2)
    plan = concrete_plan(model, adapter=adapt(model))
    assert list(plan) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]


def test_pattern_that_matches_nothing_lists_existing_names(gpt):
    with pytest.raises(ValueError, match=r"'blocks\.\*\.mlp\.fc1' matches no submodule.*blocks\.0\.mlp\.up"):
        concrete_plan(gpt, {"blocks.*.mlp.fc1": "colwise"}, adapter=adapt(gpt))
    with pytest.raises(ValueError, match="matches no submodule"):
        concrete_plan(gpt, {"blocks.*.nothing": None}, adapter=adapt(gpt))


@pytest.mark.parametrize(
    ("name", "style", "fits"),
    [
        ("blocks.0.ln1", "rowwise", "sequence"),
        ("head.proj", "embedding_rowwise", "colwise"),
        ("embed.tok", "colwise_gather", "embedding_rowwise"),
        ("blocks.0.attn.q", "sequence", "rowwise"),
    ],
)
def test_style_that_does_not_fit_the_module_type(gpt, name, style, fits):
    with pytest.raises(ValueError, match=rf"Style '{style}' does not fit '{name}'.*{fits}"):
        concrete_plan(gpt, {name: style}, adapter=adapt(gpt))


def test_unknown_style_and_gather_input_without_sharded_projection(gpt):
    with pytest.raises(ValueError, match="use one of colwise, rowwise"):
        concrete_plan(gpt, {"blocks.0.attn.q": "columnwise"}, adapter=adapt(gpt))
    with pytest.raises(ValueError, match="'blocks.0.mlp' has 'gather_input' but no column-sharded"):
        concrete_plan(gpt, {"blocks.*.mlp.up": None, "blocks.*.mlp.down": None}, adapter=adapt(gpt))


def test_conflicting_patterns_in_one_source(gpt):
    with pytest.raises(ValueError, match="both match 'blocks.0.attn.q'"):
        concrete_plan(gpt, {"blocks.*.attn.q": "colwise", "blocks.0.attn.*": "rowwise"}, adapter=adapt(gpt))


def test_validate_accepts_dividing_sizes(gpt):
    plan = concrete_plan(gpt, sequence_parallel=True, adapter=adapt(gpt))
    for size in (1, 2, 4):
        validate_tensor_parallel(gpt, plan, size, adapter=adapt(gpt))


def test_validate_names_heads_and_valid_sizes(gpt):
    plan = concrete_plan(gpt, adapter=adapt(gpt))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn has 4 heads.*divide every sharded dimension: 1, 2, 4\."):
        validate_tensor_parallel(gpt, plan, 3, adapter=adapt(gpt))
    with pytest.raises(ValueError, match="positive integer"):
        validate_tensor_parallel(gpt, plan, 0, adapter=adapt(gpt))


def test_validate_names_hidden_and_vocabulary():
    with torch.device("meta"):
        # 6 heads of width 8: tp=4 divides d_model=48 and the MLP (192) but not the heads or the vocabulary 250.
        model = GPT(vocab_size=250, d_model=48, n_layer=1, n_head=6, seq_len=16).build()
    plan = concrete_plan(model, adapter=adapt(model))
    with pytest.raises(ValueError) as info:
        validate_tensor_parallel(model, plan, 4, adapter=adapt(model))
    message = str(info.value)
    assert "embed.tok has num_embeddings=250" in message and "blocks.0.attn has 6 heads" in message
    assert "head.proj has out_features=250" in message
    assert message.endswith("Sizes that divide every sharded dimension: 1, 2.")
    # Hidden width: a colwise Linear with 6 output features under tp=4.
    mlp = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    with pytest.raises(ValueError, match=r"0 has out_features=6; 1 has in_features=6\..*: 1, 2, 3, 6\."):
        validate_tensor_parallel(mlp, concrete_plan(mlp, {"0": "colwise", "1": "rowwise"}, adapter=adapt(mlp)), 4,
                                 adapter=adapt(mlp))


def test_validate_skips_names_missing_from_a_stage(gpt):
    # A pipeline stage holds some layers under their original names.
    stage = nn.Module()
    stage.blocks = nn.ModuleDict({"1": gpt.blocks["1"]})
    adapter = adapt(gpt)  # the whole model's, as the engine asks it about each stage
    validate_tensor_parallel(stage, concrete_plan(gpt, adapter=adapter), 2, adapter=adapter)


def test_loss_parallel_context_disabled_is_a_no_op():
    with loss_parallel_context(False):
        loss = nn.functional.cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 4]))
    assert loss.ndim == 0


def test_styles_added_for_hugging_face_plans():
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    hf_names = {"0": "embedding_colwise", "1": "rowwise_replicated_input", "2": "sequence_local"}
    plan = concrete_plan(model, hf_names, adapter=adapt(model))
    assert isinstance(plan["0"], ColwiseParallel) and plan["0"].output_layouts == (Replicate(),)
    assert plan["1"].input_layouts == (Replicate(),) and plan["1"].output_layouts == (Replicate(),)
    assert "2" not in plan  # norms act only under sequence parallelism
    sp = concrete_plan(model, hf_names, sequence_parallel=True, adapter=adapt(model))
    assert sp["1"].output_layouts == (Shard(1),)
    assert isinstance(sp["2"], SequenceParallel) and sp["2"].use_local_output


def test_scatter_input_slices_the_stream_only_under_sequence_parallel():
    model = nn.Sequential(nn.Linear(8, 8))
    assert concrete_plan(model, {"0": "scatter_input"}, adapter=adapt(model)) == {}
    style = concrete_plan(model, {"0": "scatter_input"}, sequence_parallel=True, adapter=adapt(model))["0"]
    assert style.input_layouts == (Replicate(),) and style.desired_input_layouts == (Shard(1),)
    assert style.use_local_output


@pytest.mark.parametrize("plan", [{}, {"2": "replicated_grad_sum"}], ids=["empty", "no-sharding-style"])
def test_a_plan_that_shards_nothing_is_refused_for_more_than_one_rank(plan):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
    resolved = concrete_plan(model, plan, adapter=adapt(model))
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2, but .* Sequential (is empty|only moves activations)"
    ):
        validate_tensor_parallel(model, resolved, 2, adapter=adapt(model))
    validate_tensor_parallel(model, resolved, 1, adapter=adapt(model))  # one rank: nothing to shard is fine
    # A pipeline stage may hold no planned layer.
    validate_tensor_parallel(model, resolved, 2, require_sharding=False, adapter=adapt(model))
