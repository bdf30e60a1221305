"""Ranking, refusals for memory, cluster files, the override line, and the ``strategy=planned`` path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.cli.plan import compose
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner import SearchSpace, Workload, load_cluster, make_plan, overrides
from lightning_parallel.planner.cluster import cluster_from_dict
from lightning_parallel.planner.plan import strategy_overrides
from lightning_parallel.planner.profile import profile_module
from lightning_parallel.planner.shapes import llama3_shape
from lightning_parallel.runtime.config_dir import CONFIG_DIR
from lightning_parallel.scaling import Reference


def fake_timer(layers: int):
    return lambda micro: [1e-3 * micro] * layers


@pytest.fixture(scope="module")
def gpt_shape():
    torch.manual_seed(0)
    shape = profile_module(
        GPT(seq_len=16, d_model=32, n_layer=2, n_head=4, vocab_size=64).build(), torch.randint(0, 64, (2, 16))
    )
    return replace(shape, measured_seconds=fake_timer(len(shape.layers)))  # no timing in tests


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIG_DIR / "cluster").glob("*.yaml")))
def test_every_shipped_cluster_loads(name: str) -> None:
    cluster = load_cluster(name, CONFIG_DIR)
    assert cluster.devices_per_node >= 1 and cluster.memory_per_device > 0


def test_cluster_files_inherit_and_refuse_missing_keys() -> None:
    h200, h100 = load_cluster("h200_node", CONFIG_DIR), load_cluster("h100_node", CONFIG_DIR)
    assert h200.peak_flops == h100.peak_flops and h200.memory_per_device > h100.memory_per_device
    with pytest.raises(ValueError, match="lacks"):
        cluster_from_dict({"name": "x"})
    with pytest.raises(ValueError, match="No cluster description"):
        load_cluster("nowhere", CONFIG_DIR)
    with pytest.raises(ValueError, match="needs peak_tflops"):
        cluster_from_dict({**_values("h100_node"), "peak_tflops": None})


def _values(name: str) -> dict:
    from lightning_parallel.planner.cluster import _read

    return _read(CONFIG_DIR / "cluster" / f"{name}.yaml")


def test_a_memory_cap_refuses_replicas_and_says_why(gpt_shape) -> None:
    work = Workload("none", Reference(), 8)
    roomy = make_plan(gpt_shape, load_cluster("cpu", CONFIG_DIR), 4, work, SearchSpace(deepspeed_stages=()))
    dp4 = next(p for p in roomy.ranked if p.candidate.name == "dp4 b8")
    capped = replace(roomy.cluster, memory_per_device=dp4.memory.total - 1)
    plan = make_plan(gpt_shape, capped, 4, work, SearchSpace(deepspeed_stages=()))
    refused = {r.label: r.reason for r in plan.rejected}
    assert refused["dp4 b8"].startswith("does not fit")
    assert plan.ranked and all(p.memory.total <= capped.memory_per_device for p in plan.ranked)
    predicted = [float(f"{p.throughput:.9g}") for p in plan.ranked]
    assert predicted == sorted(predicted, reverse=True)


def test_nothing_fits_is_an_error_that_names_the_remedies() -> None:
    plan = make_plan(llama3_shape("llama3-70b"), load_cluster("h100_node", CONFIG_DIR), 8,
                     Workload("fixed_global_batch", Reference(8, 1e-4), 1), SearchSpace(microbatch_factors=(1,)))
    with pytest.raises(ValueError, match="more devices"):
        plan.best


def test_override_lines_compose_into_the_layout(gpt_shape) -> None:
    work = Workload("none", Reference(), 8)
    plan = make_plan(gpt_shape, load_cluster("cpu", CONFIG_DIR), 4, work,
                     SearchSpace(checkpointing=("none", "full")))
    from hydra.utils import instantiate

    from lightning_parallel.cli.preflight import layout_of

    picked = {p.candidate.engine + str(p.candidate.pp > 1) + str(p.candidate.tp > 1): p.candidate for p in plan.ranked}
    for c in picked.values():
        cfg = compose(["model=gpt_tiny", *overrides(c, work, devices=4)])
        assert cfg.trainer.devices == 4
        strategy = instantiate(cfg.strategy)
        if c.engine == "hybrid":
            layout = layout_of(strategy, 4)
            assert (layout.data_parallel, layout.pipeline_parallel, layout.tensor_parallel) == (c.dp, c.pp, c.tp)
            assert strategy.options.zero_stage == c.zero


def test_checkpointing_overrides_are_valid_options() -> None:
    from lightning_parallel.planner.candidates import Candidate

    c = Candidate("hybrid", 2, 1, 1, 0, "-", 1, 1, 8, 1, 16, checkpointing="full")
    line = strategy_overrides(c)
    assert "strategy.activation_checkpointing=full" in line
    for mode in ("none", "full", "selective"):
        ParallelOptions(activation_checkpointing=mode)


def test_planned_strategy_resolves_to_the_chosen_layout(tmp_path: Path, monkeypatch) -> None:
    from lightning_parallel.cli import planned
    from lightning_parallel.cli.preflight import preflight

    monkeypatch.setenv("LP_PLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(planned, "shape_of", lambda cfg: _tiny_measured(cfg))
    cfg = compose(["model=gpt_tiny", "strategy=planned", "trainer.devices=2", "data.seq_len=16"])
    rows = planned.plan_if_asked(cfg)
    assert rows["planned layout"] and "fastest predicted" in rows["why"] and "(cached)" not in rows["plan"]
    assert "_target_" in cfg.strategy and "planned" not in cfg.strategy
    strategy, layout = preflight(cfg)
    assert layout.world_size == 2
    again = compose(["model=gpt_tiny", "strategy=planned", "trainer.devices=2", "data.seq_len=16"])
    assert planned.plan_if_asked(again)["plan"].endswith("(cached)")
    assert again.strategy == cfg.strategy
    assert planned.plan_if_asked(compose(["model=gpt_tiny"])) == {}  # other strategies are left alone


def _tiny_measured(cfg):
    from hydra.utils import instantiate

    model = instantiate(cfg.model).build()
    shape = profile_module(model, torch.randint(0, 64, (2, int(cfg.data.seq_len))))
    return replace(shape, measured_seconds=fake_timer(len(shape.layers)))


def test_replicated_data_parallelism_is_predicted_as_ddp_and_deepspeed_pays_its_engine(gpt_shape) -> None:
    """ZeRO 0 without other axes runs on plain tensors (torch's DDP, parallel/replicated.py): no DTensor cost, the
    same step as Lightning's DDP; with tensor parallelism beside it the data axis is FSDP2 again and pays it.
    DeepSpeed pays its engine's measured per-byte cost on this machine (conf/cluster/cpu.yaml)."""
    cluster = load_cluster("cpu", CONFIG_DIR)
    assert cluster.dtensor_param_overhead > 0 and cluster.deepspeed_overhead_per_byte > 0
    plan = make_plan(gpt_shape, cluster, 4, Workload("none", Reference(), 8), SearchSpace(deepspeed_stages=(1,)))
    step = {p.candidate.name: p.step_time for p in plan.ranked}
    assert step["dp4 b8"] == pytest.approx(step["dp4 ddp b8"])
    assert step["dp4 ds1 b8"] > step["dp4 ddp b8"]
    without = make_plan(gpt_shape, replace(cluster, deepspeed_overhead_per_byte=0.0), 4,
                        Workload("none", Reference(), 8), SearchSpace(deepspeed_stages=(1,)))
    assert {p.candidate.name: p.step_time for p in without.ranked}["dp4 ds1 b8"] < step["dp4 ds1 b8"]
    fsdp = make_plan(gpt_shape, replace(cluster, dtensor_param_overhead=0.0), 4, Workload("none", Reference(), 8),
                     SearchSpace(deepspeed_stages=(1,)))
    dp2tp2 = {p.candidate.name: p.step_time for p in fsdp.ranked}
    assert step["dp2xtp2 b8"] > dp2tp2["dp2xtp2 b8"]  # FSDP2 beside tensor parallelism: DTensor parameters
