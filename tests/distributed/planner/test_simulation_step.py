"""``lp-simulate``'s step is a real run's: at 4 gloo ranks, for every layout of ``step_runs.STEP_LAYOUTS`` (ZeRO 2/3,
HSDP, tensor and context parallelism; the DDP path's collectives are DDP's C++ reducer's), the collectives each rank's
simulated class issues in one step -- by kind, mesh axis, count and bytes -- equal those the rank's real first step
issues, counted by the same counter in the real run, and the bytes autograd saves in the simulated forward on
``meta`` are within 10% of those the real forward saves. For pipelined layouts (``step_runs.PIPELINED_LAYOUTS``) the
schedule's sends and receives of a real step equal the simulated ones."""

import pytest

from lightning_parallel.testing import run_processes
from tests.distributed.planner.step_runs import PIPELINED_LAYOUTS, STEP_LAYOUTS, WORLD, measure_steps, simulated_step

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_processes(measure_steps, WORLD, STEP_LAYOUTS + PIPELINED_LAYOUTS, timeout=900)


@pytest.mark.parametrize("name", STEP_LAYOUTS)
def test_simulated_step_collectives_and_activations_equal_a_real_first_step(name, measured):
    simulation = simulated_step(name)
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in range(WORLD):
        real = measured[rank][name]
        assert real["collectives"], (name, rank, "the real step counted nothing: the counter is not in the step")
        assert list(by_rank[rank].collectives) == real["collectives"], (name, rank)
        simulated, saved = by_rank[rank].activation_bytes, real["activation_bytes"]
        assert abs(simulated - saved) <= 0.1 * saved, (name, rank, simulated, saved)


@pytest.mark.parametrize("name", PIPELINED_LAYOUTS)
def test_simulated_pipeline_sends_and_receives_equal_a_real_step(name, measured):
    """The schedule's point-to-point transfers of a real (second) step, by count and bytes, on every rank."""
    simulation = simulated_step(name)
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in range(WORLD):
        real = sorted((c for c in measured[rank][name]["collectives"] if c["kind"] in ("send", "recv")),
                      key=lambda c: c["kind"])  # a later stage receives first: the order is the schedule's
        assert real, (name, rank, "the real step counted no send or receive")
        assert sorted(by_rank[rank].collectives, key=lambda c: c["kind"]) == real, (name, rank)


@pytest.mark.parametrize("stage", [0, 1])
def test_simulated_gpipe_activations_are_a_real_steps_within_ten_percent(stage, measured):
    """Under GPipe every micro-batch's saved tensors are alive at once at the end of the forwards, so the bytes a
    real step's forwards save are the simulated peak: micro-batches in flight (4) x one micro-batch's. The last
    stage's include what its loss saves (the log-probabilities, as large as the logits: the schedule runs the loss
    in the stage's forward; the simulated stage once left it out, 29% low)."""
    simulation = simulated_step("dp2 x pp2 gpipe")
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in [r for r in range(WORLD) if by_rank[r].stages == (stage,)]:
        simulated, saved = by_rank[rank].activation_bytes, measured[rank]["dp2 x pp2 gpipe"]["activation_bytes"]
        print(f"stage {stage} rank {rank}: simulated {simulated:,} B, real {saved:,} B")
        assert abs(simulated - saved) <= 0.1 * saved, (rank, simulated, saved)
