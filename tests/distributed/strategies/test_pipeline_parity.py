"""PipelineParallelStrategy gives the losses of one process on the same global batch, on every rank."""

from functools import partial

import pytest

from lightning_parallel.strategies import PipelineParallelStrategy
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_cases

pytestmark = pytest.mark.slow

BATCH = 16
TOL = 1e-5
EXTRA = {"accumulate": {"accumulate_grad_batches": 2}, "clip": {"gradient_clip_val": 0.5}}


class SumLossPipeline(PipelineParallelStrategy):
    """A deliberately broken pipeline: micro-batch gradients are summed, not averaged."""

    def setup(self, trainer):
        super().setup(trainer)
        self.pipeline_runner.microbatch_scale = 1.0


def _cases(strategies: dict, optimizers=("sgd", "adamw"), extras=("plain", "accumulate", "clip"), data_parallel=1):
    cases = {}
    for name, strategy in strategies.items():
        for opt in optimizers:
            for extra in extras:
                cases[f"{name}/{opt}/{extra}"] = dict(strategy=strategy, global_batch=BATCH, data_parallel=data_parallel,
                                                      optimizer=opt, trainer_kwargs=EXTRA.get(extra))
    return cases


def _reference(cases):
    single = {name: {**kw, "strategy": "auto", "data_parallel": 1} for name, kw in cases.items()}
    return run_processes(fit_cases, 1, single)[0]


def _assert_parity(per_rank, reference):
    for name, ref in reference.items():
        for rank, results in enumerate(per_rank):
            diff = max_abs_difference(results[name], ref)
            assert diff < TOL, f"{name} rank {rank}: max |diff| {diff:.2e}"
        # every rank reports the very same loss
        assert all(results[name] == per_rank[0][name] for results in per_rank), name


def test_two_stages_gpipe_1f1b_and_interleaved_match_one_process():
    strategies = {
        "gpipe": partial(PipelineParallelStrategy, schedule="gpipe"),
        "1f1b": partial(PipelineParallelStrategy, schedule="1f1b"),
        "interleaved": partial(PipelineParallelStrategy, schedule="interleaved_1f1b", stages_per_rank=2),
    }
    cases = _cases(strategies)
    _assert_parity(run_processes(fit_cases, 2, cases, timeout=600), _reference(cases))


def test_four_stages_1f1b_match_one_process():
    cases = _cases({"1f1b": partial(PipelineParallelStrategy, schedule="1f1b")}, extras=("plain", "clip"))
    _assert_parity(run_processes(fit_cases, 4, cases, timeout=600), _reference(cases))


def test_parity_check_fails_for_a_wrong_gradient_scale():
    # Negative control: micro-batch losses summed instead of averaged give gradients 4x too
    # large; the same comparison must flag it.
    cases = _cases({"broken": SumLossPipeline}, optimizers=("sgd",), extras=("plain",))
    per_rank = run_processes(fit_cases, 2, cases, timeout=300)
    reference = _reference(cases)
    assert max_abs_difference(per_rank[0]["broken/sgd/plain"], reference["broken/sgd/plain"]) > 1e-3


def test_zero_bubble_schedules_time_partition_and_value_clipping_match_one_process():
    strategies = {
        "interleaved_zero_bubble": partial(PipelineParallelStrategy, schedule="interleaved_zero_bubble", stages_per_rank=2),
        "zbv": partial(PipelineParallelStrategy, schedule="zbv", stages_per_rank=2),
        "looped_bfs": partial(PipelineParallelStrategy, schedule="looped_bfs", stages_per_rank=2),
        "1f1b/time": partial(PipelineParallelStrategy, schedule="1f1b", partition="time"),
        "1f1b/cuts": partial(PipelineParallelStrategy, schedule="1f1b", partition=[2]),
    }
    cases = _cases(strategies, optimizers=("adamw",), extras=("plain",))
    cases["1f1b/value-clip"] = dict(strategy=partial(PipelineParallelStrategy, schedule="1f1b"), global_batch=BATCH, data_parallel=1,
                                    optimizer="sgd", trainer_kwargs={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"})
    _assert_parity(run_processes(fit_cases, 2, cases, timeout=600), _reference(cases))
