"""Enumeration of layouts and the reasons refused ones give (no processes, no timing)."""

from __future__ import annotations

import pytest

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.planner import LayerShape, ModelShape, Param, SearchSpace, Workload, enumerate_layouts
from lightning_parallel.scaling import Reference


def toy_shape(layers: int = 4, heads: int = 4) -> ModelShape:
    """A shape of ``layers`` identical layers of one tensor-sharded 8x8 matrix each."""
    layer = LayerShape("l", (Param((8, 8), 0), Param((8,))), fwd_flops=1.0, activation_sharded=8.0,
                       activation_replicated=8.0, output_bytes=32.0)
    return ModelShape("toy", tuple(layer for _ in range(layers)), tp_divides=(("heads", heads),))


def work(batch: int = 8, rule: str = "none", global_batch=None) -> Workload:
    return Workload(rule, Reference(global_batch, 1e-3), batch)


def test_every_size_triple_is_a_candidate_or_refused() -> None:
    candidates, rejected = enumerate_layouts(toy_shape(layers=2, heads=2), 8, work())
    seen = {(c.dp, c.pp, c.tp) for c in candidates}
    refused = {r.label.split()[0] for r in rejected}
    for dp, pp, tp in [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 8, 1), (1, 1, 8), (2, 4, 1)]:
        assert (dp, pp, tp) in seen or f"dp{dp}xpp{pp}xtp{tp}" in refused
    for c in candidates:
        ParallelLayout(8, c.dp, c.pp, c.tp)  # every candidate is a valid layout of the world


def test_refusals_name_the_reason() -> None:
    candidates, rejected = enumerate_layouts(toy_shape(layers=2, heads=2), 8, work(batch=4))
    reasons = {r.label: r.reason for r in rejected}
    assert "too few layers" in reasons["dp1xpp8xtp1"]
    assert "heads/widths not divisible" in reasons["dp2xpp1xtp4"] and "heads=2" in reasons["dp2xpp1xtp4"]
    assert not any(c.tp > 2 for c in candidates)
    assert not any(c.pp > 2 for c in candidates)


def test_microbatches_split_the_batch_and_follow_the_schedule_rules() -> None:
    space = SearchSpace(schedules=("1f1b", "interleaved_1f1b", "zbv"), microbatch_factors=(1, 2, 4))
    candidates, rejected = enumerate_layouts(toy_shape(layers=4), 2, work(batch=4), space)
    piped = [c for c in candidates if c.pp == 2]
    assert piped and all(c.batch_size % c.microbatches == 0 for c in piped)
    assert {c.stages_per_rank for c in piped if c.schedule == "1f1b"} == {1}
    assert {c.stages_per_rank for c in piped if c.schedule in ("interleaved_1f1b", "zbv")} == {2}
    assert any(r.reason.startswith("micro-batches do not split the batch") and "microbatches=8" in r.reason
               for r in rejected)  # 4 samples, 8 micro-batches


def test_zero_and_deepspeed_only_where_they_apply() -> None:
    candidates, _ = enumerate_layouts(toy_shape(), 4, work())
    assert all(c.zero == 0 for c in candidates if c.dp == 1 and c.engine == "hybrid")
    deepspeed = [c for c in candidates if c.engine == "deepspeed"]
    assert {c.zero for c in deepspeed} == {1, 2, 3} and all(c.pp == c.tp == 1 for c in deepspeed)


def test_lightnings_ddp_is_offered_on_data_parallelism_alone_without_checkpointing() -> None:
    from lightning_parallel.planner.plan import strategy_overrides

    space = SearchSpace(checkpointing=("none", "full"))
    candidates, _ = enumerate_layouts(toy_shape(), 4, work(), space)
    ddp = [c for c in candidates if c.engine == "ddp"]
    assert ddp and all(c.pp == c.tp == c.cp == c.ep == 1 and c.dp > 1 and c.checkpointing == "none" for c in ddp)
    assert strategy_overrides(ddp[0]) == ["strategy=ddp"] and "ddp" in ddp[0].name
    assert not [c for c in enumerate_layouts(toy_shape(), 4, work(), SearchSpace(ddp=False))[0] if c.engine == "ddp"]


def test_a_planned_ddp_layout_runs_lightnings_ddp_strategy() -> None:
    """strategy=planned builds the shipped ddp config for a "ddp" candidate, not the hybrid strategy's zero 0."""
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_parallel.cli import planned
    from lightning_parallel.planner.candidates import Candidate

    c = Candidate("ddp", 4, 1, 1, 0, "-", 1, 1, 4, 1, 16)
    node = planned.strategy_node(c)
    assert type(instantiate(node)) is DDPStrategy
    planned.check_resolves(c, node, 4)


def test_fixed_global_batch_tries_batch_sizes_and_refuses_what_does_not_divide() -> None:
    candidates, rejected = enumerate_layouts(toy_shape(), 4, work(batch=3, rule="fixed_global_batch", global_batch=8))
    dp4 = {(c.batch_size, c.accumulate) for c in candidates if c.dp == 4 and c.engine == "hybrid" and c.zero == 0}
    assert dp4 == {(1, 2), (2, 1)}
    assert all(c.global_batch == 8 for c in candidates)
    assert any(r.reason.startswith("batch does not divide") and "b3" in r.label for r in rejected)


def test_checkpointing_modes_are_enumerated_when_asked() -> None:
    space = SearchSpace(checkpointing=("none", "full"))
    candidates, _ = enumerate_layouts(toy_shape(), 2, work(), space)
    assert {c.checkpointing for c in candidates} == {"none", "full"}


@pytest.mark.parametrize("world", [1, 6])
def test_worlds_without_factors_still_enumerate(world: int) -> None:
    candidates, _ = enumerate_layouts(toy_shape(layers=6, heads=6), world, work(batch=6))
    assert all(c.dp * c.pp * c.tp == world for c in candidates) and candidates


def test_zero_2_in_units_of_layers_is_offered_predicted_with_fewer_collectives_and_planned_as_such() -> None:
    """ZeRO 2 with layers grouped into FSDP2 units (``strategy.bucket_size_mb``) beside one unit per layer: the
    same memory, one all-gather and reduce-scatter per unit instead of per layer; lp-plan's override line and
    ``strategy=planned`` both carry the unit size."""
    from dataclasses import replace

    from hydra.utils import instantiate

    from lightning_parallel.cli import planned
    from lightning_parallel.planner import load_cluster
    from lightning_parallel.planner.plan import strategy_overrides
    from lightning_parallel.planner.predict import predict
    from lightning_parallel.runtime.config_dir import CONFIG_DIR

    candidates, _ = enumerate_layouts(toy_shape(layers=8), 4, work())
    units = [c for c in candidates if c.units_mb]
    assert units and all(c.engine == "hybrid" and c.zero == 2 and c.units_mb == 25 for c in units)
    per_layer = next(c for c in candidates if c == replace(units[0], units_mb=0.0))
    cluster = load_cluster("h200_node", CONFIG_DIR)
    grouped, alone = predict(toy_shape(layers=8), cluster, units[0]), predict(toy_shape(layers=8), cluster, per_layer)
    assert grouped.comm < alone.comm and grouped.memory.total == alone.memory.total
    assert "strategy.bucket_size_mb=25" in strategy_overrides(units[0]) and "u25" in units[0].name
    node = planned.strategy_node(units[0])
    assert instantiate(node).options.bucket_bytes == 25 * 2**20
    assert not [c for c in enumerate_layouts(toy_shape(), 4, work(), SearchSpace(zero2_units_mb=()))[0]
                if c.units_mb]
