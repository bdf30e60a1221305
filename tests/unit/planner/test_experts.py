"""The expert axis in the planner: shapes that know their experts, candidates, memory, all-to-all bytes, overrides.

No processes: the byte formula is checked against hand-computed numbers here (and against counted messages of real
runs in ``benchmarks/expert_parallel.py``).
"""

from __future__ import annotations

import json
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
    make_plan,
)
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.experts import sent_bytes, traffic
from lightning_parallel.planner.hf_shapes import MOE_CONFIGS, config_shape, moe_layers, named_shape
from lightning_parallel.planner.memory import setup_bytes, state_bytes, working_bytes
from lightning_parallel.planner.plan import strategy_overrides
from lightning_parallel.planner.predict import predict
from lightning_parallel.planner.profile import profile_module
from lightning_parallel.planner.shapes import ExpertShape
from lightning_parallel.scaling import Reference

MIB = 2**20
EXPERTS = ExpertShape(num_experts=4, top_k=2, d_model=64, hidden=256, tokens_per_sample=16, expert_params=2 * 64 * 256)


def moe_shape(layers: int = 1, experts: ExpertShape = EXPERTS) -> ModelShape:
    """``layers`` layers of one tensor-sharded 8x8 matrix and one MoE module of grouped ``[E, 64, 256]`` and
    ``[E, 256, 64]`` experts (512 KiB of fp32 for 4 experts)."""
    e = experts.num_experts
    layer = LayerShape("moe", (Param((8, 8), 0), Param((e, 64, 256), expert=True), Param((e, 256, 64), expert=True)),
                       fwd_flops=1e3, activation_sharded=8.0, activation_replicated=8.0, output_bytes=32.0,
                       moe_modules=1)
    # step_bytes=0: AdamW's per-tensor step counters are tested in test_memory.py; here only the elements count
    return ModelShape("moe", tuple(layer for _ in range(layers)), experts=experts, step_bytes=0)


def tiny_cluster(memory: float) -> Cluster:
    link = Link(1e9, 1e9, 1e-5, a2a_bandwidth=0.5e9)
    return Cluster("tiny", 4, memory, "peak", link, link, peak_flops=1e12, efficiency=0.5)


def work(batch: int = 4) -> Workload:
    return Workload("none", Reference(None, 1e-3), batch)


def base(**sizes) -> Candidate:
    return replace(Candidate("hybrid", 4, 1, 1, 0, "-", 1, 1, 4, 1, 16), **sizes)


@pytest.fixture(scope="module")
def gpt_moe():
    torch.manual_seed(0)
    moe = {"every": 2, "num_experts": 8, "top_k": 2, "aux_loss_weight": 0.01}
    model = GPT(seq_len=32, d_model=16, n_layer=2, n_head=2, vocab_size=64, moe=moe).build()
    shape = profile_module(model, torch.randint(0, 64, (2, 32)))
    return replace(shape, measured_seconds=lambda micro: [1e-3 * micro] * len(shape.layers))  # no timing in tests


def test_the_gpt_recipe_shape_knows_its_experts_and_refuses_pipelines(gpt_moe) -> None:
    assert gpt_moe.experts == ExpertShape(8, 2, 16, 64, 32, 2 * 16 * 64, 4)  # hidden = mlp_ratio x d_model
    assert [layer.moe_modules for layer in gpt_moe.layers] == [0, 0, 1, 0]  # embed, blocks 0 and 1, head
    assert [layer.expert_params for layer in gpt_moe.layers] == [0, 0, 8 * 2 * 16 * 64, 0]
    assert [axis for axis, _ in gpt_moe.split_refusals] == ["pipeline"]  # the balancing loss in training_step
    candidates, rejected = enumerate_layouts(gpt_moe, 4, work(), SearchSpace(deepspeed_stages=()))
    assert candidates and all(c.pp == 1 for c in candidates)
    assert any(r.reason.startswith("the model refuses the pipeline split: moe=") for r in rejected)


def test_expert_sizes_divide_data_x_context_and_the_experts() -> None:
    six = moe_shape(layers=4, experts=replace(EXPERTS, num_experts=6))
    candidates, rejected = enumerate_layouts(six, 4, work())
    assert {(c.dp * c.cp, c.ep) for c in candidates if c.tp == 1} == {(4, 1), (4, 2), (2, 1), (2, 2), (1, 1)}
    refused = {r.label: r.reason for r in rejected}
    assert refused["dp4xpp1xtp1 ep4"] == ("experts do not split: expert_parallel_size=4 does not divide "
                                          "num_experts=6: use a size among [1, 2, 3, 6]")
    assert all(c.engine == "hybrid" for c in candidates if c.ep > 1)  # DeepSpeed shards no experts
    assert {c.name for c in candidates if c.ep == 2 and c.dp == 4 and c.zero == 2} == {
        "dp4 ep2 zero2 b4", "dp4 ep2 zero2 u25 b4",  # the experts whole on their 2 expert-data ranks
        "dp4 ep2-shard zero2 b4", "dp4 ep2-shard zero2 u25 b4"}  # ... or sharded over them (expert_data_shard)
    assert not any(c.expert_shard for c in candidates if c.dp * c.cp == c.ep)  # one expert-data rank: nothing to cut
    dense = replace(six, experts=None)
    assert all(c.ep == 1 for c in enumerate_layouts(dense, 4, work())[0])
    only = enumerate_layouts(six, 4, work(), SearchSpace(expert_sizes=(1,)))[0]
    assert {c.ep for c in only} == {1}


def test_experts_divide_by_the_expert_size_and_are_not_sharded_by_zero() -> None:
    shape, dense, experts = moe_shape(), 64, 2 * 4 * 64 * 256  # elements of one layer
    # ep = 1: experts are ordinary parameters, ZeRO-2 shards them (dim 0, 4 experts) over the 4 replicas.
    assert state_bytes(shape, base(zero=2), [0]) == (4 * (dense + experts) / 4, 4 * (dense + experts) / 4,
                                                     2 * 4 * (dense + experts) / 4)
    # ep = 4: a rank holds one expert whole; ZeRO-2 shards only the dense matrix.
    assert state_bytes(shape, base(zero=2, ep=4), [0]) == (4 * (dense / 4 + experts / 4),) * 2 + (
        2 * 4 * (dense / 4 + experts / 4),)
    # ep = 2 over 4 replicas: two ranks hold the same two experts, and both keep all their states (not sharded).
    assert state_bytes(shape, base(zero=2, ep=2), [0])[0] == 4 * (dense / 4 + experts / 2)
    # ... unless expert_data_shard cuts them again (dim 1) over those two: half the expert bytes, states included.
    sharded = state_bytes(shape, base(zero=2, ep=2, expert_shard=True), [0])
    assert sharded == (4 * (dense / 4 + experts / 4),) * 2 + (2 * 4 * (dense / 4 + experts / 4),)
    # FSDP2 gathers dense parameters only; an experts module is materialised whole before it is sliced.
    assert working_bytes(shape, base(ep=4), [0]) == 4 * dense
    assert working_bytes(shape, base(zero=2), [0]) == 4 * (dense + experts)
    assert working_bytes(shape, base(), [0]) == 0  # ZeRO 0 over data alone is torch's DDP: nothing gathered
    assert setup_bytes(shape, base(ep=4), [0]) == 4 * (dense + experts / 4) + 4 * experts
    assert setup_bytes(shape, base(), [0]) == 4 * (dense + experts) + 4 * experts / 2  # the largest tensor


def test_all_to_all_bytes_follow_the_uniform_router_formula() -> None:
    """Per rank, MoE module and micro-batch of T tokens: dispatch = combine = (ep-1)/ep * T k d e; forward sends
    dispatch + combine, backward both again."""
    t, k, d, e = 32, 2, 64, 4
    one = 3 / 4 * t * k * d * e  # ep 4: three quarters of the copies leave the rank
    assert one == 12288
    assert sent_bytes(EXPERTS, 4, t) == (2 * one, 2 * one) == (24576, 24576)
    assert sent_bytes(EXPERTS, 2, t) == (t * k * d * e, t * k * d * e)
    assert sent_bytes(EXPERTS, 1, t) == (0.0, 0.0)
    link = Link(1e9, 1e9, 1e-5, a2a_bandwidth=0.5e9)
    seconds = traffic(EXPERTS, 4, t, link)
    assert seconds.forward_seconds == pytest.approx(3 * 3 * 1e-5 + 24576 / 0.5e9)  # counts, dispatch, combine
    assert seconds.backward_seconds == pytest.approx(2 * 3 * 1e-5 + 24576 / 0.5e9)
    assert traffic(EXPERTS, 1, t, link).forward_bytes == 0.0


def test_predicted_expert_bytes_per_step_count_micro_batches_context_and_recompute() -> None:
    shape, cluster = moe_shape(layers=2), tiny_cluster(MIB)
    forward, backward = sent_bytes(EXPERTS, 4, 4 * 16)  # 4 samples of 16 tokens per rank
    c = base(ep=4)
    assert predict(shape, cluster, c).expert_bytes == pytest.approx(2 * (forward + backward))  # 2 MoE layers
    full = predict(shape, cluster, replace(c, checkpointing="full"))
    assert full.expert_bytes == pytest.approx(2 * (2 * forward + backward))
    accumulated = predict(shape, cluster, replace(c, accumulate=3))
    assert accumulated.expert_bytes == pytest.approx(3 * 2 * (forward + backward))
    context = replace(c, dp=2, cp=2, cp_method="ring")  # context ranks hold half of each sample's tokens
    assert predict(shape, cluster, context).expert_bytes == pytest.approx(2 * sum(sent_bytes(EXPERTS, 4, 2 * 16)))
    assert predict(shape, cluster, base()).expert_bytes == 0.0
    assert predict(shape, cluster, c).expert_comm > 0


def test_expert_parallelism_is_chosen_when_the_experts_fit_no_other_way() -> None:
    """One MoE layer of 512 KiB of experts, 4 ranks, 0.8 MiB each: without an expert axis AdamW's states fill 2 MiB,
    and ZeRO, which shards them, gathers the whole layer to compute it (0.5 MiB more under ZeRO-2, 1 MiB with
    ZeRO-3's prefetch); four expert ranks keep one expert each and gather none."""
    space = SearchSpace(deepspeed_stages=(), microbatch_factors=(1,))
    plan = make_plan(moe_shape(), tiny_cluster(0.8 * MIB), 4, work(), space)
    assert plan.ranked and {p.candidate.ep for p in plan.ranked} == {4}
    best = plan.best.candidate
    assert (best.dp, best.ep) == (4, 4)
    refused = {r.label: r.reason for r in plan.rejected if r.kind == "memory"}
    assert refused["dp4 zero3 b4"].startswith("does not fit") and "gathered 0.00105" in refused["dp4 zero3 b4"]
    assert "dp4 ep2 b4" in refused  # two experts per rank: 1 MiB of states
    assert plan.best.memory.states == pytest.approx(16 * (64 + 2 * 64 * 256))  # one expert, AdamW, fp32


def test_overrides_and_planned_strategy_carry_the_expert_axis() -> None:
    from hydra.utils import instantiate

    from lightning_parallel.cli import planned
    from lightning_parallel.cli.plan import compose
    from lightning_parallel.cli.preflight import layout_of

    c = base(ep=2, zero=2)
    line = strategy_overrides(c)
    assert "strategy.expert_parallel_size=2" in line
    assert not any("expert" in o for o in strategy_overrides(base()))
    cfg = compose(["model=gpt_moe", *line, "trainer.devices=4"])
    layout = layout_of(instantiate(cfg.strategy), 4)
    assert (layout.data_parallel, layout.expert_parallel) == (4, 2)
    node = planned.strategy_node(c)
    assert node["expert_parallel_size"] == 2
    planned.check_resolves(c, node, 4)
    with pytest.raises(ValueError, match=r"\(experts 2\), but .* \(experts 1\)"):
        planned.check_resolves(c, {**node, "expert_parallel_size": 1}, 4)


def test_the_table_shows_the_expert_size_and_its_all_to_alls() -> None:
    from rich.console import Console

    from lightning_parallel.planner.table import ranked_table

    plan = make_plan(moe_shape(), tiny_cluster(64 * MIB), 4, work(), SearchSpace(deepspeed_stages=()))
    console = Console(record=True, width=250)
    console.print(ranked_table(plan, top=len(plan.ranked)))
    text = console.export_text()
    assert "ep sent/step" in text and "dp4 ep4 b4" in text
    row = next(line for line in text.splitlines() if "dp4 ep4 b4 " in line)
    assert "0.09 MiB" in row  # 4 x 24 KiB: 4 x 16 tokens' copies, 3/4 of them leave, 4 times


def test_hugging_face_configs_give_expert_shapes(tmp_path) -> None:
    mixtral = named_shape("mixtral-8x7b", seq_len=4096)
    assert mixtral.num_params == 46_702_792_704  # Mixtral 8x7B's published 46.7B parameters
    assert mixtral.experts == ExpertShape(8, 2, 4096, 14336, 4096, 3 * 4096 * 14336, 2)
    assert sum(layer.moe_modules for layer in mixtral.layers) == 32
    assert sum(layer.expert_params for layer in mixtral.layers) == 32 * 8 * 3 * 4096 * 14336
    olmoe = named_shape("olmoe-1b-7b", seq_len=2048)
    assert (olmoe.experts.num_experts, olmoe.experts.top_k, olmoe.experts.hidden) == (64, 8, 1024)
    qwen = {**MOE_CONFIGS["qwen3-30b-a3b"], "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_layers(qwen) == [1, 5]
    assert moe_layers({"num_hidden_layers": 6, "num_experts": 4, "first_k_dense_replace": 2}) == [2, 3, 4, 5]
    dense = config_shape({k: v for k, v in qwen.items() if k != "num_experts"}, "dense")
    assert dense.experts is None and all(layer.moe_modules == 0 for layer in dense.layers)
    with pytest.raises(ValueError, match="Unknown shape 'nowhere'"):
        named_shape("nowhere")
    config = tmp_path / "my-moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"text_config": qwen}))  # a multimodal config nests the decoder's values
    from_file = named_shape(str(config), seq_len=1024)
    assert from_file.name == "my-moe" and from_file.experts == ExpertShape(128, 8, 2048, 768, 1024, 3 * 2048 * 768, 2)
    assert [i for i, layer in enumerate(from_file.layers) if layer.moe_modules] == [2, 6]  # after the embedding
