"""The multi-process harness: results per rank, failures with tracebacks, timeouts that kill."""

import os
import time

import pytest

from lightning_parallel.testing import DistributedRunError, run_processes


def _all_reduce_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": rank,
        "sum": float(value),
        "threads": os.environ["OMP_NUM_THREADS"],
        "world": world_size,
        "marker": os.environ.get("LP_TEST_MARKER"),
        "cwd": os.getcwd(),
        "seed": torch.initial_seed(),
    }


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    return rank


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(120)
    return rank


def test_each_rank_returns_its_result_through_gloo(tmp_path, monkeypatch):
    run_processes(_all_reduce_rank, 1)  # the fork server is running before the environment changes
    monkeypatch.setenv("LP_TEST_MARKER", "set after the first launch")
    monkeypatch.chdir(tmp_path)
    results = run_processes(_all_reduce_rank, 3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 and r["threads"] == "1" and r["world"] == 3 for r in results)
    # Ranks start as spawned processes would: the parent's environment and directory of now, fresh seeds.
    assert all(r["marker"] == "set after the first launch" and r["cwd"] == str(tmp_path) for r in results)
    assert len({r["seed"] for r in results}) == 3


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(DistributedRunError, match=r"Rank 1 of 2 failed:(.|\n)*rank one broke on purpose"):
        run_processes(_fail_on_rank_one, 2)


def test_hanging_rank_times_out_and_is_killed():
    run_processes(_fail_on_rank_one, 1)  # starts the fork server (imports torch) outside the deadline below
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"Timed out .* ranks \[0\]"):
        # Rank 1, forked from the running server, must finish inside it even on a loaded 2-core machine.
        run_processes(_hang_on_rank_zero, 2, timeout=8)
    assert time.monotonic() - start < 60
