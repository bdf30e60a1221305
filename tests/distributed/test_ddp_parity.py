"""DDP on 2 gloo processes gives the losses of 1 process on the same global batch."""

import pytest

from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_losses

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return run_processes(fit_losses, 1, "auto", GLOBAL_BATCH, 1)[0]


def test_ddp_two_processes_match_one_process(reference):
    per_rank = run_processes(fit_losses, 2, "ddp", GLOBAL_BATCH, 2)
    for rank, losses in enumerate(per_rank):
        assert max_abs_difference(losses, reference) < 1e-5, f"rank {rank}"
    assert reference[-1] < reference[0]  # it trained


def test_parity_check_detects_a_different_global_batch(reference):
    # Negative control: half the global batch per step is a different optimisation,
    # and the comparison must say so.
    other = run_processes(fit_losses, 1, "auto", GLOBAL_BATCH // 2, 1)[0]
    assert max_abs_difference(other, reference) > 1e-3
