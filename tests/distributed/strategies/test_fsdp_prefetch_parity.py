"""FSDP2 with explicit prefetch (``fsdp_prefetch``) on 2 gloo processes matches one process.

Prefetch only moves when all-gathers are issued; the numbers must not change: fp32, AdamW, clipping
0.5, 10 steps, ResidualMLP (6 FSDP2 units), every rank within 1e-6 of one process.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_cases
from tests.distributed.strategies.parity import assert_parity, reference_losses

pytestmark = pytest.mark.slow

TOL = 1e-6


def _case(strategy, global_batch=16):
    return dict(strategy=strategy, global_batch=global_batch, data_parallel=2, optimizer="adamw",
                trainer_kwargs={"gradient_clip_val": 0.5})


def test_zero3_and_zero2_with_prefetch_match_one_process():
    cases = {"dp2/zero3/prefetch2": _case(partial(Hybrid, zero_stage=3, fsdp_prefetch=2)),
             "dp2/zero2/prefetch1": _case(partial(Hybrid, zero_stage=2, fsdp_prefetch=1))}
    per_rank = run_processes(fit_cases, 2, cases, timeout=600)
    reference = reference_losses(cases)
    print("max |diff| per case:", assert_parity(per_rank, reference, tol=TOL))
    # Negative control: the comparison tells another optimisation (half the global batch) apart.
    other = reference_losses({"half batch": _case(None, global_batch=8)})["half batch"]
    assert max_abs_difference(other, reference["dp2/zero3/prefetch2"]) > 1e-3


@pytest.mark.extended
def test_prefetch_within_pipeline_stages_matches_one_process():
    cases = {"dp2xpp2/zero3/prefetch2": _case(partial(Hybrid, pipeline_parallel_size=2, zero_stage=3, fsdp_prefetch=2)),
             "hsdp2x2/zero3/prefetch2": {**_case(partial(Hybrid, zero_stage=3, data_shard_size=2, fsdp_prefetch=2)),
                                         "data_parallel": 4}}
    per_rank = run_processes(fit_cases, 4, cases, timeout=900)
    print("max |diff| per case:", assert_parity(per_rank, reference_losses(cases), tol=TOL))
