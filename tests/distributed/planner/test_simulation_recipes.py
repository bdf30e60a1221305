"""``lp-simulate`` on the ViT and DLRM recipes through the hybrid strategy's path, against real 4-rank gloo runs:
the parameter, gradient and AdamW bytes each rank stores after its first step are equal to the byte; a whole step's
collectives equal by kind, axis, count and bytes and its saved activations within 10% (pipelined: the schedule's
sends and receives equal). Layouts: ViT dp2 x tp2 ZeRO 3 and dp2 x pp2; DLRM dp2 x tp2 (tables sharded by rows) and
dp4 ZeRO 2."""

import pytest

from lightning_parallel.testing import run_processes
from tests.distributed.planner.recipe_runs import RECIPE_CASES, WORLD, measure_recipes, pipelined, simulated_recipe

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # one 4-rank launch of 4 fits: about 40 s here
KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_processes(measure_recipes, WORLD, list(RECIPE_CASES), timeout=900)


@pytest.mark.parametrize("name", list(RECIPE_CASES))
def test_simulated_recipe_bytes_and_step_equal_a_real_run(name, measured):
    simulation = simulated_recipe(name)
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in range(WORLD):
        real, simulated = measured[rank][name], by_rank[rank]
        assert {key: getattr(simulated, key) for key in KEYS} == {key: real[key] for key in KEYS}, (name, rank)
        if pipelined(name):
            transfers = sorted((c for c in real["collectives"] if c["kind"] in ("send", "recv")),
                               key=lambda c: c["kind"])
            assert transfers and sorted(simulated.collectives, key=lambda c: c["kind"]) == transfers, (name, rank)
            continue
        assert real["collectives"] and list(simulated.collectives) == real["collectives"], (name, rank)
        saved = real["activation_bytes"]
        assert abs(simulated.activation_bytes - saved) <= 0.1 * saved, (name, rank, simulated.activation_bytes, saved)
