"""Zero-bubble schedules (a backward split into an input pass and a weight pass) with FSDP2 on the data axis.

Under ZeRO 2 the parameters stay gathered from forward to backward, and data 2 x pipeline 2 gives one process's
losses; ZeRO 3 is refused before start (see ``parallel/checks.py``: torch 2.13's weight pass ran after FSDP2 resharded
the stage, 1.34 off under zbv before the refusal).
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import fit_cases, tiny_gpt
from tests.distributed.strategies.parity import assert_parity, reference_losses

pytestmark = pytest.mark.slow


def _case(schedule, microbatches):
    strategy = partial(Hybrid, data_parallel_size=2, pipeline_parallel_size=2, stages_per_rank=2, schedule=schedule,
                       microbatches=microbatches, zero_stage=2)
    return dict(strategy=strategy, global_batch=8, data_parallel=2, steps=6, model_factory=partial(tiny_gpt, n_layer=4),
                dataset="text_padded", trainer_kwargs={"gradient_clip_val": 0.5})


def test_zero_bubble_schedules_under_zero2_match_one_process():
    cases = {"zbv": _case("zbv", 2), "interleaved_zero_bubble": _case("interleaved_zero_bubble", 4)}
    worst = assert_parity(run_processes(fit_cases, 4, cases, timeout=900), reference_losses(cases))
    print("max |loss - one process|:", worst)
