"""HybridParallelStrategy: 2-D and 3-D layouts, ZeRO-2/3 over the data axis, match one process."""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import fit_cases, tiny_gpt
from tests.distributed.strategies.parity import assert_parity, reference_losses

pytestmark = pytest.mark.slow

CLIP = {"gradient_clip_val": 0.5}


def _mlp(strategy, data_parallel, optimizer="sgd", **trainer_kwargs):
    return dict(strategy=strategy, global_batch=16, data_parallel=data_parallel, optimizer=optimizer,
                trainer_kwargs=trainer_kwargs)


# AdamW is the default cell of every layout (its sharded optimizer state is the harder case); plain SGD
# repeats the layouts without optimizer state and runs with `pytest -m extended`.
@pytest.mark.parametrize("optimizers", [("adamw",), pytest.param(("sgd",), marks=pytest.mark.extended)],
                         ids=["adamw", "sgd"])
def test_four_process_layouts_match_one_process(optimizers):
    cases = {}
    for opt in optimizers:
        cases[f"dp2xpp2/{opt}"] = _mlp(partial(Hybrid, pipeline_parallel_size=2), 2, opt, **CLIP)
        cases[f"dp2xtp2/{opt}"] = _mlp(partial(Hybrid, tensor_parallel_size=2), 2, opt)
        cases[f"pp2xtp2/{opt}"] = _mlp(
            partial(Hybrid, pipeline_parallel_size=2, tensor_parallel_size=2), 1, opt, **CLIP
        )
        cases[f"dp2xpp2/zero2/{opt}"] = _mlp(partial(Hybrid, pipeline_parallel_size=2, zero_stage=2), 2, opt)
        cases[f"dp2xpp2/zero3/{opt}"] = _mlp(partial(Hybrid, pipeline_parallel_size=2, zero_stage=3), 2, opt, **CLIP)
    if "adamw" in optimizers:
        cases["gpt/pp2xtp2/sp+lp"] = dict(
            strategy=partial(Hybrid, pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                             loss_parallel=True),
            global_batch=8, data_parallel=1, model_factory=tiny_gpt, dataset="text", trainer_kwargs=CLIP,
        )
    per_rank = run_processes(fit_cases, 4, cases, timeout=900)
    assert_parity(per_rank, reference_losses(cases))
    for name in cases:  # the loss reported to Lightning is the same on every rank
        assert all(r[name] == per_rank[0][name] for r in per_rank), name


def test_three_dimensional_layout_on_eight_processes_matches_one_process():
    cases = {
        "dp2xpp2xtp2/adamw/clip": _mlp(
            partial(Hybrid, pipeline_parallel_size=2, tensor_parallel_size=2), 2, "adamw", **CLIP
        ),
        "gpt/dp2xpp2xtp2/zero2": dict(
            strategy=partial(Hybrid, pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=2),
            global_batch=8, data_parallel=2, model_factory=tiny_gpt, dataset="text",
        ),
    }
    per_rank = run_processes(fit_cases, 8, cases, timeout=900)
    assert_parity(per_rank, reference_losses(cases))
