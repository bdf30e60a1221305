"""leave_process_group: after a success a rank leaves only once every rank has finished its end of the run."""

import time
from pathlib import Path

import pytest

from lightning_parallel.testing import run_processes

pytestmark = pytest.mark.slow


def _leave(rank: int, world_size: int, folder: str, together: bool) -> dict:
    import torch.distributed as dist

    from lightning_parallel.runtime.process_group import leave_process_group

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    done = Path(folder) / "rank0_done"
    if rank == 0:
        time.sleep(1.5)  # rank 0's end of the run: the results table, metrics.json
        done.write_text("written")
    leave_process_group(together)
    return {"rank0_done_when_left": done.exists(), "initialized": dist.is_initialized()}


@pytest.mark.parametrize("together", [True, False], ids=["after success", "after failure"])
def test_after_a_success_every_rank_leaves_only_when_rank_0_has_finished(tmp_path, together):
    results = run_processes(_leave, 2, str(tmp_path), together, timeout=120)
    assert [r["initialized"] for r in results] == [False, False]
    assert results[0]["rank0_done_when_left"]
    # Negative control: without the barrier rank 1 leaves while rank 0 is still writing.
    assert results[1]["rank0_done_when_left"] is together
