"""Pipeline split without processes: schedules, stage placement, names and parameters conserved."""

import itertools

import pytest
import torch

from lightning_parallel.parallel.pipeline.partition import partition_layers
from lightning_parallel.parallel.pipeline.schedules import (
    SCHEDULES,
    available_schedules,
    check_microbatches,
    stage_ids_for_rank,
    validate_schedule,
)
from lightning_parallel.parallel.pipeline.stages import (
    RemovedLayer,
    StageModule,
    layer_names,
    shared_parameters,
    split_module,
)
from lightning_parallel.testing.models import ResidualMLP

SPR = {"one": 1, "many": 2, "two": 2}


def _stages_per_rank(schedule):
    return SPR[SCHEDULES[schedule][1]]


@pytest.mark.parametrize(("schedule", "pp"), list(itertools.product(available_schedules(), [2, 4])))
def test_each_stage_runs_on_exactly_one_rank(schedule, pp):
    spr = _stages_per_rank(schedule)
    owned = [s for rank in range(pp) for s in stage_ids_for_rank(schedule, rank, pp, spr)]
    assert sorted(owned) == list(range(pp * spr))


@pytest.mark.parametrize(
    ("schedule", "partition"),
    list(itertools.product(available_schedules(), ["uniform", "parameters"])),
)
def test_split_conserves_every_parameter_name_and_count(schedule, partition):
    pp, spr = 2, _stages_per_rank(schedule)
    reference = ResidualMLP(width=16, depth=6)
    full = {name: p.clone() for name, p in reference.state_dict().items()}
    seen: dict[str, torch.Tensor] = {}
    for rank in range(pp):
        model = ResidualMLP(width=16, depth=6)  # same seed: same weights
        layers = model.pipeline_layers()
        bounds = partition_layers(layers, pp * spr, partition)
        local = stage_ids_for_rank(schedule, rank, pp, spr)
        split, stages = split_module(model, layers, bounds, local)
        state = model.state_dict()
        assert not set(state) & set(seen), "a parameter lives on two ranks"
        seen.update(state)
        # the stage modules expose the same names as the trimmed model
        assert set().union(*(s.state_dict().keys() for s in stages)) == set(state)
    assert set(seen) == set(full)
    assert all(torch.equal(seen[k], full[k]) for k in full)
    assert sum(split.parameters_per_stage) == sum(p.numel() for p in reference.parameters())


def test_stage_module_computes_the_layers_in_order():
    model = ResidualMLP(width=8, depth=2)
    x = torch.randn(3, 8)
    layers = model.pipeline_layers()
    names = layer_names(model, layers)
    stage = StageModule(list(zip(names, layers)))
    torch.testing.assert_close(stage(x), model(x))


def test_removed_layers_refuse_to_run_and_say_where_they_live():
    model = ResidualMLP(width=8, depth=2)
    split_module(model, model.pipeline_layers(), [0, 2, 4], [1])
    assert isinstance(model.inp, RemovedLayer)
    with pytest.raises(RuntimeError, match="stage 0"):
        model(torch.randn(2, 8))


def test_per_rank_parameters_are_about_one_over_p():
    total = sum(p.numel() for p in ResidualMLP(width=32, depth=8).parameters())
    for pp in (2, 4):
        for rank in range(pp):
            model = ResidualMLP(width=32, depth=8)
            bounds = partition_layers(model.pipeline_layers(), pp, "parameters")
            split_module(model, model.pipeline_layers(), bounds, [rank])
            local = sum(p.numel() for p in model.parameters())
            assert abs(local / total - 1 / pp) < 0.5 / pp


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("1f1b", 2, 2, 4), "stages_per_rank=1"),
        (("interleaved_1f1b", 2, 1, 4), "stages_per_rank >= 2"),
        (("zbv", 2, 3, 4), "exactly two stages"),
        (("1f1b", 4, 1, 2), "at least as many micro-batches"),
        (("interleaved_1f1b", 2, 2, 3), "multiple of pipeline_parallel_size"),
        (("pipedream", 2, 1, 4), "Unknown schedule"),
        (("1f1f", 2, 1, 4), "Unknown schedule '1f1f': did you mean '1f1b'\\?"),
        (("gpipe", 2, 1, 0), "positive integer"),
    ],
)
def test_unsupported_combinations_are_refused_early(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


@pytest.mark.parametrize(("batch", "micro"), [(6, 4), (2, 4)])
def test_batches_that_do_not_split_evenly_are_an_error_not_a_silent_shrink(batch, micro):
    with pytest.raises(ValueError, match="microbatches"):
        check_microbatches(batch, micro)


def test_layers_must_cover_all_parameters_and_may_be_tied():
    model = ResidualMLP(width=8, depth=2)
    with pytest.raises(ValueError, match="outside every pipeline layer"):
        layer_names(model, model.pipeline_layers()[:-1])
    model.out.weight = model.inp.weight
    layers = model.pipeline_layers()
    names = layer_names(model, layers)  # a tie is kept in step across ranks (pipeline_tied), not refused
    assert shared_parameters(names, layers) == [((0, f"{names[0]}.weight"), (len(layers) - 1, f"{names[-1]}.weight"))]
