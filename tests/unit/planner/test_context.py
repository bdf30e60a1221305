"""The context axis in the planner: candidates, activation memory / cp, ring and all-to-all bytes, overrides, table.

No processes: the byte formulas are checked against hand-computed numbers here (and against counted messages of
real runs in ``benchmarks/context_parallel.py``).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.planner import (
    LayerShape,
    ModelShape,
    Param,
    SearchSpace,
    Workload,
    enumerate_layouts,
    load_cluster,
    make_plan,
)
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.cluster import Link
from lightning_parallel.planner.context import sent_bytes, traffic
from lightning_parallel.planner.memory import activation_bytes, state_bytes
from lightning_parallel.planner.plan import strategy_overrides
from lightning_parallel.planner.predict import predict
from lightning_parallel.planner.profile import profile_module
from lightning_parallel.planner.shapes import AttentionShape, llama3_shape
from lightning_parallel.runtime.config_dir import CONFIG_DIR
from lightning_parallel.scaling import Reference


def attention_shape(seq: int = 16, heads: int = 2, layers: int = 4) -> ModelShape:
    """``layers`` identical layers, each with one attention module over ``seq`` tokens of ``heads`` heads."""
    layer = LayerShape("l", (Param((8, 8), 0), Param((8,))), fwd_flops=1.0, activation_sharded=8.0,
                       activation_replicated=8.0, output_bytes=32.0, attention_modules=1)
    return ModelShape("attn", tuple(layer for _ in range(layers)), tp_divides=(("heads", heads),),
                      attention=AttentionShape(seq, heads, heads, 4))


def work(batch: int = 8) -> Workload:
    return Workload("none", Reference(None, 1e-3), batch)


@pytest.fixture(scope="module")
def gpt_shape():
    torch.manual_seed(0)
    shape = profile_module(GPT(seq_len=64, d_model=32, n_layer=2, n_head=4, vocab_size=64).build(),
                           torch.randint(0, 64, (2, 64)))
    return replace(shape, measured_seconds=lambda micro: [1e-3 * micro] * len(shape.layers))  # no timing in tests


def test_context_sizes_only_for_models_with_attention_and_sequences_that_split() -> None:
    no_attention = replace(attention_shape(), attention=None)
    candidates, rejected = enumerate_layouts(no_attention, 4, work())
    assert candidates and all(c.cp == 1 for c in candidates)
    refusals = [r.reason.split(":")[0] for r in rejected if r.label == "context_parallel_size>1"]
    assert refusals == ["no attention to split"]

    candidates, rejected = enumerate_layouts(attention_shape(seq=12, heads=2), 4, work())  # 12 = 2 x 2 x 3
    assert {c.cp for c in candidates} == {1, 2}
    refused = {r.label: r.reason for r in rejected}
    assert refused["cp4"].startswith("sequence does not split") and "context_parallel_size=4" in refused["cp4"]
    for c in candidates:
        assert c.world == 4 and c.replicas == c.dp * c.cp
        assert (c.cp_method == "-") == (c.cp == 1)


def test_ulysses_only_where_the_heads_split_and_ring_everywhere() -> None:
    candidates, rejected = enumerate_layouts(attention_shape(seq=16, heads=2), 4, work())
    methods = {(c.cp, c.tp): {x.cp_method for x in candidates if (x.cp, x.tp) == (c.cp, c.tp)} for c in candidates}
    assert methods[(2, 1)] == {"ring", "ulysses"}  # 2 heads over 2 context ranks
    assert methods[(4, 1)] == {"ring"}  # 2 heads cannot split over 4
    assert methods[(2, 2)] == {"ring"}  # 1 head per tensor rank cannot split over 2
    reasons = {r.label: r.reason for r in rejected}
    assert reasons["dp1xcp4xpp1xtp1 ulysses"].startswith("heads do not split")
    assert "context_parallel_method='ring'" in reasons["dp1xcp4xpp1xtp1 ulysses"]


def test_context_ranks_are_replicas_for_zero_and_never_run_deepspeed() -> None:
    candidates, _ = enumerate_layouts(attention_shape(), 2, work())
    cp2 = [c for c in candidates if c.cp == 2]
    assert {c.zero for c in cp2} == {0, 2, 3} and all(c.engine == "hybrid" for c in cp2)
    shape = attention_shape()
    zero3 = next(c for c in cp2 if c.zero == 3)
    # FSDP2 shards each 8x8 weight's rows over data x context = 2 ranks: half the parameters.
    assert state_bytes(shape, zero3, [0])[0] == 4 * (4 * 8 + 8 // 2)
    assert state_bytes(shape, replace(zero3, zero=0), [0])[0] == 4 * (8 * 8 + 8)


def test_ring_and_ulysses_bytes_follow_their_formulas() -> None:
    """Per rank, attention module and micro-batch of b samples (s = S / cp tokens, head size d, e bytes):

    ring:    forward (cp-1) * kv; backward (cp-1) * kv + cp * dkv, with kv = 2 b G s d e, dkv = 2 b G s d max(e, 4);
    ulysses: (cp-1)/cp * b s d e * (2 H + 2 G') each way, G' = G when G % cp == 0, else H (k, v repeated).
    """
    a = AttentionShape(seq_len=1024, q_heads=8, kv_heads=2, head_dim=16, act_bytes=2)
    b, cp, s = 2, 4, 256
    kv, dkv = 2 * b * 2 * s * 16 * 2, 2 * b * 2 * s * 16 * 4
    assert sent_bytes(a, "ring", cp, 1, b) == (3 * kv, 3 * kv + 4 * dkv) == (196608, 720896)
    # 2 kv heads do not split over 4 ranks: k and v travel with 8 heads.
    assert sent_bytes(a, "ulysses", cp, 1, b) == (3 / 4 * b * s * 16 * 2 * (16 + 16),) * 2 == (393216, 393216)
    gqa4 = replace(a, kv_heads=4)
    assert sent_bytes(gqa4, "ulysses", cp, 1, b) == (3 / 4 * b * s * 16 * 2 * (16 + 8),) * 2
    # Tensor parallelism divides the heads each rank sends; one context rank sends nothing.
    assert sent_bytes(a, "ring", cp, 2, b) == (3 * kv / 2, (3 * kv + 4 * dkv) / 2)
    assert sent_bytes(a, "ring", 1, 1, b) == sent_bytes(a, "ulysses", 1, 1, b) == (0.0, 0.0)


def test_seconds_are_alpha_beta_on_the_context_link() -> None:
    a = AttentionShape(seq_len=1024, q_heads=8, kv_heads=8, head_dim=16, act_bytes=4)
    link = Link(bandwidth=1e9, gather_bandwidth=0.5e9, latency=1e-4, a2a_bandwidth=0.25e9)
    ring = traffic(a, "ring", 2, 1, 1, link)
    kv = 2 * 8 * 512 * 16 * 4
    assert ring.forward_seconds == pytest.approx(1e-4 + kv / 1e9)
    assert ring.backward_seconds == pytest.approx(1e-4 + kv / 1e9 + 2 * (1e-4 + kv / 1e9))  # dkv in fp32 too
    ulysses = traffic(a, "ulysses", 2, 1, 1, link)
    assert ulysses.forward_seconds == pytest.approx(4 * 1e-4 + ulysses.forward_bytes / 0.25e9)
    assert Link(1e9, 0.5e9, 1e-4).all_to_all_bandwidth == 0.5e9  # unset: the all-gather rate


def test_activations_divide_by_the_context_size(gpt_shape) -> None:
    base = Candidate("hybrid", 1, 1, 1, 0, "-", 1, 1, 2, 1, 2)
    for layer in range(len(gpt_shape.layers)):
        whole = activation_bytes(gpt_shape, base, layer, 2)
        for cp in (2, 4):
            split = replace(base, cp=cp, cp_method="ring")
            assert activation_bytes(gpt_shape, split, layer, 2) == pytest.approx(whole / cp)
            full = replace(split, checkpointing="full")
            assert activation_bytes(gpt_shape, full, layer, 2) == pytest.approx(
                activation_bytes(gpt_shape, replace(base, checkpointing="full"), layer, 2) / cp)


def test_predicted_context_bytes_per_step_count_every_attention_module_and_the_recompute(gpt_shape) -> None:
    cluster = load_cluster("cpu", CONFIG_DIR)
    c = Candidate("hybrid", 1, 1, 1, 0, "-", 1, 1, 2, 1, 2, cp=2, cp_method="ring")
    forward, backward = sent_bytes(gpt_shape.attention, "ring", 2, 1, 2)
    assert predict(gpt_shape, cluster, c).context_bytes == pytest.approx(2 * (forward + backward))  # 2 blocks
    full = predict(gpt_shape, cluster, replace(c, checkpointing="full"))
    assert full.context_bytes == pytest.approx(2 * (2 * forward + backward))
    assert predict(gpt_shape, cluster, replace(c, cp=1, cp_method="-")).context_bytes == 0.0
    assert full.context_comm > 0


def test_a_long_sequence_fits_only_with_context_parallelism() -> None:
    """Llama 3 8B on 131,072 tokens per sample, one 8-GPU H100 node: without a context axis even full checkpointing
    and tensor 8 leave too many activations; the plan splits the sequence."""
    shape = llama3_shape("llama3-8b", 131072)
    space = SearchSpace(deepspeed_stages=(), checkpointing=("none", "full", "selective"), microbatch_factors=(1,))
    plan = make_plan(shape, load_cluster("h100_node", CONFIG_DIR), 8,
                     Workload("fixed_global_batch", Reference(1, 1e-4), 1), space)
    assert plan.ranked and all(p.candidate.cp > 1 for p in plan.ranked)
    assert plan.best.candidate.cp >= 4
    whole = [r for r in plan.rejected if r.kind == "memory" and "cp" not in r.label.split()[0]]
    assert whole and all(r.reason.startswith("does not fit") for r in whole)
    # The same model on 8,192 tokens fits without one.
    short = make_plan(llama3_shape("llama3-8b", 8192), load_cluster("h100_node", CONFIG_DIR), 8,
                      Workload("fixed_global_batch", Reference(1, 1e-4), 1), space)
    assert any(p.candidate.cp == 1 for p in short.ranked)


def test_overrides_and_planned_strategy_carry_the_context_axis() -> None:
    from hydra.utils import instantiate

    from lightning_parallel.cli import planned
    from lightning_parallel.cli.plan import compose
    from lightning_parallel.cli.preflight import layout_of

    c = Candidate("hybrid", 2, 1, 1, 2, "-", 1, 1, 4, 1, 8, cp=2, cp_method="ulysses")
    line = strategy_overrides(c)
    assert "strategy.context_parallel_size=2" in line and "strategy.context_parallel_method=ulysses" in line
    cfg = compose(["model=gpt_tiny", *line, "trainer.devices=4"])
    strategy = instantiate(cfg.strategy)
    layout = layout_of(strategy, 4)
    assert (layout.data_parallel, layout.context_parallel, layout.pipeline_parallel) == (2, 2, 1)
    assert strategy.options.context_parallel_method == "ulysses"
    node = planned.strategy_node(c)
    assert node["context_parallel_size"] == 2 and node["context_parallel_method"] == "ulysses"
    planned.check_resolves(c, node, 4)
    stale = {**node, "data_parallel_size": "auto", "context_parallel_size": 1}  # a plan from before the context axis
    with pytest.raises(ValueError, match="context 2 x .* runs data 4 x context 1"):
        planned.check_resolves(c, stale, 4)


def test_the_table_shows_the_context_size_and_what_it_sends(gpt_shape) -> None:
    from rich.console import Console

    from lightning_parallel.planner.table import ranked_table

    plan = make_plan(gpt_shape, load_cluster("cpu", CONFIG_DIR), 2, work(2), SearchSpace(deepspeed_stages=()))
    console = Console(record=True, width=250)
    console.print(ranked_table(plan, top=len(plan.ranked)))
    text = console.export_text()
    assert "cp sent/step" in text and "2 ring" in text and "2 ulysses" in text and "cp2 ring b2" in text
