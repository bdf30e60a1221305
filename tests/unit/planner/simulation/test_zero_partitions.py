"""DeepSpeed ZeRO by its partition arithmetic: flat buffers padded to 2 x ranks, per-parameter ZeRO 3 partitions,
sub-groups, persistent small parameters, DeepSpeed's config defaults, and what is refused. The figures at 4 ranks are
a real DeepSpeed run's (tests/distributed/planner/test_simulation_deepspeed.py)."""

from functools import partial

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.planner.simulation.rank_run import build_on_meta
from lightning_parallel.planner.simulation.zero_partitions import ZeroSettings, _sub_groups, simulate_zero

# The distributed test's tiny GPT: 46,648 parameters in two AdamW groups (36,448 and 10,200 elements).
tiny = partial(GPT, d_model=34, n_head=2, n_layer=2, seq_len=16, optimizer=partial(torch.optim.AdamW, lr=1e-3),
               warmup_steps=0)


def held(stage: int, **settings):
    (only,) = simulate_zero(build_on_meta(tiny), 4, ZeroSettings(stage, **settings)).classes
    return only.parameter_bytes, only.gradient_bytes, only.optimizer_bytes


def test_zero_1_and_2_hold_the_flat_buffers_whole_and_a_quarter_of_them_in_fp32_with_adams_state():
    # groups padded to multiples of 2 x 4 elements (already are); partitions of 9,112 and 2,550 elements
    assert held(1) == held(2) == (46648 * 4, 11662 * 4, 11662 * 4 + 2 * 11662 * 4 + 2 * 4)


def test_zero_3_cuts_each_parameter_and_keeps_small_ones_gathered():
    partitions = 11672  # sum of ceil(numel / 4) over the 37 parameters
    gathered = 46688  # the persistent parameters (all 37 under 100,000 elements), each padded to 4 x its partition
    assert held(3) == ((partitions + gathered) * 4, partitions * 4, partitions * 4 + 2 * partitions * 4 + 2 * 4)
    assert held(3, param_persistence_threshold=0)[0] == partitions * 4


def test_zero_0_is_the_model_and_its_optimizer_as_they_are():
    assert held(0) == (46648 * 4, 46648 * 4, 2 * 46648 * 4 + 37 * 4)  # AdamW: two moments and a step per tensor


def test_sub_groups_close_once_they_reach_the_size_and_deepspeeds_defaults_are_read():
    assert _sub_groups([4, 4, 4, 4, 1], 8) == [[4, 4], [4, 4], [1]]
    assert _sub_groups([4, 4], 100) == [[4, 4]]
    settings = ZeroSettings.of({"stage": 3})
    assert (settings.param_persistence_threshold, settings.sub_group_size) == (100_000, 1_000_000_000)


def test_a_precision_the_arithmetic_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="bf16-true"):
        simulate_zero(build_on_meta(tiny), 4, ZeroSettings(2), precision="bf16-true")
