"""A lighthouse that cannot be reached, or a quorum that cannot form, stops the run with an error that names the
fix within a bounded time -- never a hang."""

from __future__ import annotations

import time

import pytest

from lightning_parallel.testing.processes import DistributedRunError, run_processes
from tests.distributed.fault_tolerance.replica_runs import replica_rank

pytest.importorskip("torchft")


def test_an_unreachable_lighthouse_is_an_error_within_the_connect_timeout(tmp_path) -> None:
    ft = {"replicas": 2, "replica_id": 0, "lighthouse": "http://127.0.0.1:9", "connect_timeout": 2}
    started = time.monotonic()
    with pytest.raises(DistributedRunError, match="lighthouse at http://127.0.0.1:9 is not reachable within 2 s"):
        run_processes(replica_rank, 1, "one", 2, (), ft, str(tmp_path), timeout=120)
    assert time.monotonic() - started < 60


def test_a_quorum_that_cannot_form_is_an_error_within_the_quorum_timeout(tmp_path) -> None:
    from lightning_parallel.fault_tolerance import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=2)  # a second group never comes
    try:
        ft = {"replicas": 2, "replica_id": 0, "lighthouse": lighthouse.address(), "quorum_timeout": 3,
              "group_timeout": 1}
        started = time.monotonic()
        with pytest.raises(DistributedRunError, match="no quorum of 1 replica group.* formed within 3 s"):
            run_processes(replica_rank, 1, "one", 2, (), ft, str(tmp_path), timeout=120)
        assert time.monotonic() - started < 60
    finally:
        lighthouse.shutdown()
