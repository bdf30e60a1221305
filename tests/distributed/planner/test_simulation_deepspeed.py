"""``lp-simulate strategy=deepspeed`` is DeepSpeed's partition arithmetic, to the byte: at 4 gloo ranks, for ZeRO 0,
1, 2 and 3 (DeepSpeed's default config: ZeRO 3 keeps parameters under 100,000 elements gathered), the parameter
bytes (flat buffers, ZeRO 3's partitions and persistent parameters), the optimizer bytes (fp32 master partitions
and AdamW's state over them) and the gradient bytes after backward (ZeRO 1 and 2: this rank's partition, in
elements; ZeRO 3: its flat gradient partitions) equal a real run's on every rank."""

import pytest

from lightning_parallel.testing import run_processes
from tests.distributed.planner.deepspeed_runs import STAGES, WORLD, measure_deepspeed, simulated_deepspeed

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # one 4-rank launch of 4 DeepSpeed fits: 1-2 min here
KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_processes(measure_deepspeed, WORLD, list(STAGES), timeout=900)


@pytest.mark.parametrize("stage", STAGES)
def test_simulated_zero_bytes_per_rank_equal_a_real_deepspeed_run(stage, measured):
    (only,) = simulated_deepspeed(stage).classes
    predicted = {key: getattr(only, key) for key in KEYS}

    for rank in range(WORLD):
        assert predicted == measured[rank][stage], (stage, rank, predicted, measured[rank][stage])
