"""Stage partitioning: every layer in exactly one stage, balanced by the chosen cost."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.pipeline.partition import (
    balanced_partition,
    measure_layer_times,
    partition_layers,
    stage_of_layer,
    uniform_partition,
)


def test_uniform_split_puts_the_remainder_first():
    assert uniform_partition(6, 2) == [0, 3, 6]
    assert uniform_partition(7, 3) == [0, 3, 5, 7]


def test_balanced_split_minimises_the_heaviest_stage():
    weights = [1, 1, 1, 1, 8, 1, 1, 1, 1]
    bounds = balanced_partition(weights, 3)
    loads = [sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    assert max(loads) == 8  # the heavy layer alone (or with nothing that could move)
    assert balanced_partition([1.0] * 6, 3) == [0, 2, 4, 6]


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6])
def test_every_layer_is_owned_by_exactly_one_stage(num_stages):
    layers = [nn.Linear(4, 4 * (i % 3 + 1)) for i in range(6)]
    for method in ("uniform", "parameters"):
        bounds = partition_layers(layers, num_stages, method)
        owners = stage_of_layer(bounds)
        assert len(owners) == 6 and sorted(set(owners)) == list(range(num_stages))
        assert owners == sorted(owners)  # contiguous


def test_explicit_cut_points():
    layers = [nn.Linear(2, 2) for _ in range(6)]
    assert partition_layers(layers, 3, [2, 5]) == [0, 2, 5, 6]


@pytest.mark.parametrize(
    ("spec", "stages", "message"),
    [
        ([3], 3, "pass 2 cut points"),
        ([4, 2], 3, "strictly increasing"),
        ([0, 3], 3, "strictly increasing"),
        ("fastest", 2, "Unknown partition"),
        ("uniform", 7, "at least one layer"),
    ],
)
def test_bad_partitions_name_the_fix(spec, stages, message):
    layers = [nn.Linear(2, 2) for _ in range(6)]
    with pytest.raises(ValueError, match=message):
        partition_layers(layers, stages, spec)


def test_time_partition_uses_measured_costs():
    layers = [nn.Linear(8, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)]), nn.Linear(8, 8), nn.Linear(8, 8)]
    times = measure_layer_times(layers, torch.randn(4, 8), repeats=2)
    assert len(times) == 4 and all(t > 0 for t in times)
    # Fake, clear-cut costs: the heavy second layer gets a stage of its own.
    assert partition_layers(layers, 2, "time", layer_times=[1, 10, 1, 1]) == [0, 2, 4] or \
        partition_layers(layers, 2, "time", layer_times=[1, 10, 1, 1]) == [0, 1, 4]
    with pytest.raises(ValueError, match="layer_times"):
        partition_layers(layers, 2, "time")
