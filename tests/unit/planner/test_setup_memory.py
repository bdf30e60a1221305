"""The setup peak in the planner's memory model: a model built with storage is whole on every rank before the split;
one built on ``meta`` (``configure_model``) is materialised share by share, one full-size tensor at a time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_parallel.planner import SearchSpace, Workload, load_cluster, make_plan
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.from_config import builds_in_configure_model
from lightning_parallel.planner.memory import Memory, setup_bytes, stage_layers, state_bytes
from lightning_parallel.planner.predict import predict
from lightning_parallel.planner.shapes import LayerShape, ModelShape, Param
from lightning_parallel.planner.table import ranked_table
from lightning_parallel.runtime.config_dir import CONFIG_DIR
from lightning_parallel.scaling import Reference

EMBED, WIDTH, BLOCKS = 512, 256, 16


def _layer(name: str, params: tuple[Param, ...]) -> LayerShape:
    return LayerShape(name, params, fwd_flops=1e3, activation_sharded=0.0, activation_replicated=64.0,
                      output_bytes=4.0 * WIDTH)


def toy(built_on_meta: bool = True) -> ModelShape:
    """An embedding (the largest tensor) and 16 blocks: under dp8 ZeRO-3 the step needs less than the whole model."""
    layers = (_layer("embed", (Param((EMBED, WIDTH), 0),)),
              *(_layer(f"blocks.{i}", (Param((WIDTH, WIDTH), 0), Param((WIDTH,)))) for i in range(BLOCKS)))
    return ModelShape("toy", layers, built_on_meta=built_on_meta,
                      measured_seconds=lambda micro: [1e-3 * micro] * len(layers))


def layout(dp=1, pp=1, tp=1, zero=0) -> Candidate:
    return Candidate("hybrid", dp, pp, tp, zero, "1f1b" if pp > 1 else "-", 1, pp if pp > 1 else 1, 8, 1, 8 * dp)


def _rank_layers(shape, c, rank=0):
    return [i for stage in stage_layers(shape, c)[rank] for i in stage]


@pytest.mark.parametrize("c", [layout(dp=8, zero=3), layout(dp=2, zero=2), layout(tp=2), layout(dp=2)],
                         ids=["dp8 zero3", "dp2 zero2", "tp2", "dp2 replicated"])
def test_meta_setup_peak_is_the_share_plus_the_largest_tensor_at_full_size(c):
    shape = toy()
    layers = _rank_layers(shape, c)
    share = state_bytes(shape, c, layers)[0]
    assert setup_bytes(shape, c, layers) == share + 4 * EMBED * WIDTH


def test_meta_setup_peak_without_dtensors_is_the_share():
    shape, c = toy(), layout(pp=2)  # plain tensors: each copied into place from the CPU, no full-size transient
    for rank in range(2):
        layers = _rank_layers(shape, c, rank)
        assert setup_bytes(shape, c, layers) == state_bytes(shape, c, layers)[0]


@pytest.mark.parametrize("c", [layout(dp=8, zero=3), layout(pp=2), layout(tp=2)], ids=["dp8 zero3", "pp2", "tp2"])
def test_eager_setup_peak_is_the_whole_model(c):
    shape = toy(built_on_meta=False)
    assert setup_bytes(shape, c, _rank_layers(shape, c)) == 4 * shape.num_params


def test_the_peak_is_the_larger_of_setup_and_step():
    assert Memory(1.0, 1.0, 2.0, 3.0, 1.0, setup=5.0).total == 8.0  # the step's
    assert Memory(1.0, 1.0, 2.0, 3.0, 1.0, setup=9.0).total == 9.0  # the setup's
    assert Memory(1.0, 1.0, 2.0, 3.0).setup == 0.0


def test_an_eager_build_that_does_not_fit_at_setup_is_refused_and_the_meta_build_fits():
    cluster, work = load_cluster("cpu", CONFIG_DIR), Workload("none", Reference(), 8)
    c = layout(dp=8, zero=3)
    meta, eager = predict(toy(), cluster, c).memory, predict(toy(False), cluster, c).memory
    assert meta.training == eager.training  # the step is the same; only the setup differs
    assert eager.setup > eager.training > meta.setup
    capped = replace(cluster, memory_per_device=(eager.setup + eager.training) / 2)
    space = SearchSpace(zero_stages=(3,), deepspeed_stages=(), schedules=("1f1b",), microbatch_factors=(1,))
    fits = make_plan(toy(), capped, 8, work, space)
    refused = make_plan(toy(False), capped, 8, work, space)
    name = "dp8 zero3 b8"
    assert name in [p.candidate.name for p in fits.ranked]
    reasons = {r.label: r.reason for r in refused.rejected}
    assert name not in [p.candidate.name for p in refused.ranked]
    assert reasons[name].startswith("does not fit") and "setup peak exceeds the step's" in reasons[name]
    assert "build it in configure_model()" in reasons[name]


def test_the_ranked_table_shows_the_setup_peak():
    plan = make_plan(toy(False), load_cluster("cpu", CONFIG_DIR), 8, Workload("none", Reference(), 8),
                     SearchSpace(zero_stages=(3,), deepspeed_stages=(), schedules=("1f1b",), microbatch_factors=(1,)))
    table = ranked_table(plan, 3)
    headers = [column.header for column in table.columns]
    assert headers.index("setup/rank") == headers.index("total/rank") - 1
    cells = list(table.columns[headers.index("setup/rank")].cells)
    assert cells and all(cell == f"{4 * toy().num_params / 2**20:.2f} MiB" for cell in cells), cells  # the whole model


def test_a_model_built_in_configure_model_is_planned_as_built_on_meta():
    from lightning_parallel.testing.models import DeferredResidualMLP, ResidualMLP

    assert builds_in_configure_model(DeferredResidualMLP())
    assert not builds_in_configure_model(ResidualMLP())
