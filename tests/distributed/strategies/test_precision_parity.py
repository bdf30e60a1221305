"""bf16 under every strategy: as close to one process in the same precision as that process is to fp32.

The bound is measured in the same test: the one-process run's own bf16-vs-fp32 difference on
the same model, data and steps. A layout that reduced gradients in the wrong dtype, dropped
autocast, or mis-scaled a gradient would leave it (the negative control shows the bound is
tight enough to catch a gradient scale error).
"""

from __future__ import annotations

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_parallel.strategies.deepspeed import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_cases

pytestmark = pytest.mark.slow

PRECISIONS = ("bf16-mixed", "bf16-true")
STEPS = 8


class SumLossPipeline(PipelineParallelStrategy):
    """A deliberately broken pipeline: micro-batch gradients are summed, not averaged (negative control)."""

    def setup(self, trainer):
        super().setup(trainer)
        self.pipeline_runner.microbatch_scale = 1.0


def _case(strategy, data_parallel: int, precision: str) -> dict:
    return dict(strategy=strategy, global_batch=16, data_parallel=data_parallel, optimizer="adamw", steps=STEPS,
                trainer_kwargs={"precision": precision, "gradient_clip_val": 0.5})


def _references(precisions) -> dict[str, list[float]]:
    """One process (Lightning's single-device strategy) in each precision and in fp32."""
    cases = {p: _case("auto", 1, p) for p in (*precisions, "32-true")}
    return run_processes(fit_cases, 1, cases)[0]


def _assert_within_own_bf16_error(per_rank: list[dict], reference: dict, names) -> dict:
    """Every rank of every case no further from one process in its precision than that process is from fp32."""
    found = {}
    for name in names:
        precision = name.rsplit("/", 1)[1]
        bound = max_abs_difference(reference[precision], reference["32-true"])
        worst = max(max_abs_difference(results[name], reference[precision]) for results in per_rank)
        found[name] = (worst, bound)
        assert worst <= bound, f"{name}: {worst:.3g} from one process in {precision}, whose own bf16 error is {bound:.3g}"
    return found


def test_two_process_strategies_in_bf16_match_one_process_within_its_bf16_error():
    cases = {}
    for p in PRECISIONS:
        cases[f"pipeline/{p}"] = _case(partial(PipelineParallelStrategy, pipeline_parallel_size=2), 1, p)
        cases[f"tensor/{p}"] = _case(partial(TensorParallelStrategy, tensor_parallel_size=2), 1, p)
        cases[f"dp2_zero3/{p}"] = _case(partial(HybridParallelStrategy, zero_stage=3), 2, p)
        cases[f"deepspeed_zero2/{p}"] = _case(partial(DeepSpeedDataParallelStrategy, stage=2), 2, p)
    cases["broken_pipeline/bf16-mixed"] = _case(SumLossPipeline, 1, "bf16-mixed")
    per_rank = run_processes(fit_cases, 2, cases, timeout=900)
    reference = _references(PRECISIONS)
    for p in PRECISIONS:  # bf16 really ran: one process in bf16 is not fp32
        assert max_abs_difference(reference[p], reference["32-true"]) > 1e-4, p
    _assert_within_own_bf16_error(per_rank, reference, [n for n in cases if not n.startswith("broken")])
    # Negative control: a gradient scale error (micro-batch losses summed) is far outside the bound.
    with pytest.raises(AssertionError, match="broken_pipeline/bf16-mixed"):
        _assert_within_own_bf16_error(per_rank, reference, ["broken_pipeline/bf16-mixed"])


@pytest.mark.extended
def test_four_process_layouts_in_bf16_match_one_process_within_its_bf16_error():
    cases = {}
    for p in PRECISIONS:
        cases[f"dp2xpp2_zero3/{p}"] = _case(partial(HybridParallelStrategy, pipeline_parallel_size=2, zero_stage=3), 2, p)
        cases[f"pp2xtp2/{p}"] = _case(partial(HybridParallelStrategy, pipeline_parallel_size=2, tensor_parallel_size=2), 1, p)
        cases[f"dp2xtp2_zero2/{p}"] = _case(partial(HybridParallelStrategy, tensor_parallel_size=2, zero_stage=2), 2, p)
        cases[f"deepspeed_zero3/{p}"] = _case(partial(DeepSpeedDataParallelStrategy, stage=3), 4, p)
    per_rank = run_processes(fit_cases, 4, cases, timeout=1500)
    _assert_within_own_bf16_error(per_rank, _references(PRECISIONS), list(cases))
