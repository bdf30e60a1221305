"""Every recipe trains under every strategy file of conf/strategy/ that fits it, and matches one process.

Three launches serve all cases (spawning ranks costs seconds each): one process for the
references, two processes for single-axis layouts and DeepSpeed, four for the hybrid layout.
Each case is a tiny, fixed configuration of the recipe's own model and data, so its losses
must equal one process's on the same global batches (fp32, 1e-5) and fall.
"""

import math

import pytest

from lightning_parallel.testing import max_abs_difference, run_processes
from tests.integration.recipe_runs import falling, fit_recipe_cases, reference_cases, reference_key

pytestmark = pytest.mark.slow

TOL = 1e-5
RECIPES = ("vit", "dlrm", "gpt")
DEEPSPEED = ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload")


def _case(recipe, strategy, data_parallel, *overrides):
    return dict(recipe=recipe, strategy=strategy, data_parallel=data_parallel, overrides=tuple(overrides))


TWO = {}
for _recipe in RECIPES:
    TWO[f"{_recipe}/ddp"] = _case(_recipe, "ddp", 2)
    TWO[f"{_recipe}/tensor"] = _case(_recipe, "tensor", 1)
    for _name in DEEPSPEED:
        TWO[f"{_recipe}/{_name}"] = _case(_recipe, _name, 2)
    if _recipe != "dlrm":
        TWO[f"{_recipe}/pipeline"] = _case(_recipe, "pipeline", 1)
FOUR = {
    "vit/hybrid": _case("vit", "hybrid", 1),  # pp2 x tp2
    "gpt/hybrid": _case("gpt", "hybrid", 1),
    "dlrm/hybrid": _case("dlrm", "hybrid", 2, "strategy.pipeline_parallel_size=1"),  # dp2 x tp2
    "dlrm/tensor4": _case("dlrm", "tensor", 1),  # every table in quarters
}
REFUSED = {  # layouts that do not fit: the strategy must refuse them and say why
    "dlrm/pipeline": _case("dlrm", "pipeline", 1),
}


@pytest.fixture(scope="module")
def references():
    return run_processes(fit_recipe_cases, 1, reference_cases({**TWO, **FOUR}), timeout=600)[0]


@pytest.fixture(scope="module")
def two_processes():
    return run_processes(fit_recipe_cases, 2, {**REFUSED, **TWO}, timeout=900)


@pytest.fixture(scope="module")
def four_processes():
    return run_processes(fit_recipe_cases, 4, FOUR, timeout=900)


def _check(per_rank, cases, references):
    worst = {}
    for name, kwargs in cases.items():
        reference = references[reference_key(kwargs)]["losses"]
        for rank, results in enumerate(per_rank):
            assert "error" not in results[name], f"{name} rank {rank}: {results[name]['error']}"
            losses = results[name]["losses"]
            assert all(math.isfinite(v) for v in losses), f"{name} rank {rank}: {losses}"
            assert falling(losses), f"{name} rank {rank}: loss did not fall: {losses}"
            worst[name] = max(worst.get(name, 0.0), max_abs_difference(losses, reference))
    bad = {name: diff for name, diff in worst.items() if diff >= TOL}
    assert not bad, f"max |loss - single-process loss| >= {TOL}: {bad}"


def test_references_train(references):
    for name, result in references.items():
        assert falling(result["losses"]), f"{name}: {result['losses']}"


def test_two_process_strategies_match_one_process(two_processes, references):
    _check(two_processes, TWO, references)


def test_hybrid_and_four_way_tensor_match_one_process(four_processes, references):
    _check(four_processes, FOUR, references)


def test_dlrm_under_pipeline_is_refused_with_the_reason(two_processes):
    for results in two_processes:
        message = results["dlrm/pipeline"].get("error", "")
        assert "DLRM cannot be split into pipeline stages" in message, results["dlrm/pipeline"]
        assert "pipeline_layers" in message


@pytest.mark.parametrize(
    ("name", "tensor_size", "fixture"), [("dlrm/tensor", 2, "two_processes"), ("dlrm/tensor4", 4, "four_processes")]
)
def test_embedding_tables_are_sharded_one_tensor_rank_each(request, name, tensor_size, fixture):
    for results in request.getfixturevalue(fixture):
        local, full = results[name]["embedding_bytes"]
        assert full > 0 and local * tensor_size == full, (local, full)
    for results in request.getfixturevalue("two_processes"):  # data parallelism keeps whole tables
        local, full = results["dlrm/ddp"]["embedding_bytes"]
        assert local == full
