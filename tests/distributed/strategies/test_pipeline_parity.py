"""PipelineParallelStrategy gives the losses of one process on the same global batch, on every rank.

The comparison is the package's own (``assert_layouts_match`` fixture, see
:mod:`lightning_parallel.testing.compare`): every pipeline layout against one process, per case,
on every rank -- losses of every batch, plus the global gradient norm and the learning rate of
every step and the final parameters by name.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import PipelineParallelStrategy
from lightning_parallel.testing import Case, Layout, compare_cases, max_abs_difference
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

BATCH = 16
SAMPLES = 256
STEPS = 10
TOL = 1e-5
EXTRA = {"plain": {}, "accumulate": {"accumulate_grad_batches": 2}, "clip": {"gradient_clip_val": 0.5}}
SINGLE = Layout("auto", 1, name="single")


class SumLossPipeline(PipelineParallelStrategy):
    """A deliberately broken pipeline: micro-batch gradients are summed, not averaged."""

    def setup(self, trainer):
        super().setup(trainer)
        self.pipeline_runner.microbatch_scale = 1.0


def fixed_order_data(layout) -> FixedOrderData:
    """The same global batch of ``BATCH`` samples per step on every layout, in a fixed order."""
    return FixedOrderData(regression_dataset(SAMPLES, 32), batch_size=BATCH // layout.data_parallel)


def _cases(optimizers=("sgd", "adamw"), extras=("plain", "accumulate", "clip")) -> dict[str, Case]:
    return {
        f"{opt}/{extra}": Case(partial(ResidualMLP, width=32, depth=4, optimizer=opt), fixed_order_data, EXTRA[extra])
        for opt in optimizers for extra in extras
    }


def _layouts(strategies: dict, devices: int) -> list[Layout]:
    return [SINGLE, *(Layout(strategy, devices, name=name) for name, strategy in strategies.items())]


# AdamW is every schedule's default cell (its state makes a wrong gradient show for longer); plain SGD repeats
# the same schedules and extras with `pytest -m extended` (the negative control below still uses it by default).
OPTIMIZERS = pytest.mark.parametrize("optimizer", ["adamw", pytest.param("sgd", marks=pytest.mark.extended)])


@OPTIMIZERS
def test_two_stages_gpipe_1f1b_and_interleaved_match_one_process(assert_layouts_match, optimizer):
    strategies = {
        "gpipe": partial(PipelineParallelStrategy, schedule="gpipe"),
        "1f1b": partial(PipelineParallelStrategy, schedule="1f1b"),
        "interleaved": partial(PipelineParallelStrategy, schedule="interleaved_1f1b", stages_per_rank=2),
    }
    assert_layouts_match.cases(_cases(optimizers=(optimizer,)), _layouts(strategies, 2), steps=STEPS, tolerance=TOL,
                               timeout=600)


@OPTIMIZERS
def test_four_stages_1f1b_match_one_process(assert_layouts_match, optimizer):
    strategies = {"1f1b": partial(PipelineParallelStrategy, schedule="1f1b")}
    assert_layouts_match.cases(_cases(optimizers=(optimizer,), extras=("plain", "clip")), _layouts(strategies, 4),
                               steps=STEPS, tolerance=TOL, timeout=600)


def test_parity_check_fails_for_a_wrong_gradient_scale():
    # Negative control: micro-batch losses summed instead of averaged give gradients 4x too
    # large; the same comparison must flag it (and name the pipeline layout at the first step).
    result = compare_cases(_cases(optimizers=("sgd",), extras=("plain",)), _layouts({"broken": SumLossPipeline}, 2),
                           steps=STEPS, tolerance=TOL, timeout=300)["sgd/plain"]
    reference, broken = result.runs
    assert max_abs_difference(broken.losses[0], reference.losses[0]) > 1e-3
    assert not result
    step, layout, _, _ = result.first_divergence
    assert layout == "broken" and step <= 1


def test_zero_bubble_schedules_time_partition_and_value_clipping_match_one_process(assert_layouts_match):
    strategies = {
        "interleaved_zero_bubble": partial(
            PipelineParallelStrategy, schedule="interleaved_zero_bubble", stages_per_rank=2
        ),
        "zbv": partial(PipelineParallelStrategy, schedule="zbv", stages_per_rank=2),
        "looped_bfs": partial(PipelineParallelStrategy, schedule="looped_bfs", stages_per_rank=2),
        "1f1b/time": partial(PipelineParallelStrategy, schedule="1f1b", partition="time"),
        "1f1b/cuts": partial(PipelineParallelStrategy, schedule="1f1b", partition=[2]),
    }
    assert_layouts_match.cases(_cases(optimizers=("adamw",), extras=("plain",)), _layouts(strategies, 2), steps=STEPS,
                               tolerance=TOL, timeout=600)
    # Value clipping acts on each stage's own gradients after the schedule ran: one schedule proves it, here the
    # one whose V-shaped placement puts the first and the last stage on the same rank.
    value_clip = {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}
    cases = {
        "sgd/value-clip": Case(partial(ResidualMLP, width=32, depth=4, optimizer="sgd"), fixed_order_data, value_clip)
    }
    assert_layouts_match.cases(cases, _layouts({"zbv": strategies["zbv"]}, 2), steps=STEPS, tolerance=TOL, timeout=600)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved_zero_bubble", "dualpipev"])
def test_split_backward_schedules_under_zero3_are_refused_before_any_process_group(schedule):
    """Measured before the refusal (data 2 x pipeline 2, GPT recipe): zbv 1.34, interleaved_zero_bubble 1.21 and
    dualpipev 0.034 off one process's losses -- the weight pass ran after FSDP2 resharded the stage. ZeRO 2 with the
    same schedules gives 4.8e-7 (test_zero_bubble_schedules_* above runs ZeRO 0)."""
    from lightning_parallel.parallel.checks import check_options_on_layout
    from lightning_parallel.strategies import HybridParallelStrategy

    strategy = HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2,
                                      schedule=schedule, microbatches=4, zero_stage=3)
    with pytest.raises(ValueError, match="use zero_stage=2 with this schedule"):
        check_options_on_layout(strategy.options, strategy.resolve_layout(4))
    fine = HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2,
                                  schedule=schedule, microbatches=4, zero_stage=2)
    check_options_on_layout(fine.options, fine.resolve_layout(4))
