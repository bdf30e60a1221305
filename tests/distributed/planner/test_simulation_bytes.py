"""``lp-simulate``'s bytes are a real run's, to the byte: at 4 gloo ranks, for every layout of
``simulation_runs.LAYOUTS`` (the DDP path, ZeRO 2/3, HSDP, pipeline, tensor, context, experts), the simulated
parameter, gradient and optimizer-state bytes of each rank's class equal the bytes the rank's storages hold after
its first optimizer step (AdamW; FSDP2's padded shards included). Where they differ the real run is wrong
(``REAL_RUN_BUGS``, strict xfail: the test turns green-to-red when the bug is fixed)."""

import pytest

from lightning_parallel.testing import run_processes
from tests.distributed.planner.simulation_runs import (
    LAYOUTS,
    LAYOUTS_AND_BUGS,
    REAL_RUN_BUGS,
    WORLD,
    measure_layouts,
    simulated,
)

pytestmark = pytest.mark.slow
KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_processes(measure_layouts, WORLD, list(LAYOUTS_AND_BUGS), timeout=900)


BUG = pytest.mark.xfail(strict=True, reason="the real run's bug (simulation_runs.REAL_RUN_BUGS): ZBV with ZeRO 3 "
                        "leaves the last stage without gradients or AdamW state after the first step")


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=BUG) for n in REAL_RUN_BUGS)])
def test_simulated_bytes_per_rank_equal_a_real_run_after_its_first_step(name, measured):
    simulation = simulated(name)
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in range(WORLD):
        real = measured[rank][name]
        predicted = {key: getattr(by_rank[rank], key) for key in KEYS}
        assert predicted == real, (name, rank, predicted, real)
