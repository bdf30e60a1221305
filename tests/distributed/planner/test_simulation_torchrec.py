"""``lp-simulate strategy=torchrec`` is TorchRec's plan, to the byte: at 4 gloo ranks, for table-wise, column-wise
(8-wide shards) and partly replicated (``data_parallel``) tables, with fused Adagrad and row-wise Adagrad, the
parameter, gradient and optimizer-state bytes each rank's class gives equal what the rank's storages hold after its
first step (the table shards, DDP's buckets, Adam's state on the dense part, the fused optimizers' and the replicated
tables' twins' state)."""

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import run_processes  # noqa: E402
from tests.distributed.planner.torchrec_runs import (  # noqa: E402
    TORCHREC_CASES,
    WORLD,
    measure_torchrec,
    simulated_torchrec,
)

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # one 4-rank launch of 4 TorchRec fits: about 40 s here
KEYS = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_processes(measure_torchrec, WORLD, list(TORCHREC_CASES), timeout=900)


@pytest.mark.parametrize("name", list(TORCHREC_CASES))
def test_simulated_torchrec_bytes_per_rank_equal_a_real_run_after_its_first_step(name, measured):
    simulation = simulated_torchrec(name)
    by_rank = {rank: c for c in simulation.classes for rank in c.ranks}

    for rank in range(WORLD):
        predicted = {key: getattr(by_rank[rank], key) for key in KEYS}
        assert predicted == measured[rank][name], (name, rank, predicted, measured[rank][name])
