"""``fault_tolerance.mode=local_sgd``: groups step on their own batches and meet every ``sync_every`` steps; a lost
group rejoins at the others' next meeting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_parallel.testing.faults import fail_at
from lightning_parallel.testing.replica_groups import run_replica_groups
from tests.distributed.fault_tolerance.replica_runs import (
    local_sgd_reference,
    recorded,
    replica_rank,
    slow_healing_replica_rank,
)

pytest.importorskip("torchft")

FT = {"timeout": 10, "quorum_timeout": 60, "connect_timeout": 5, "mode": "local_sgd", "sync_every": 3}


def _equal_groups(result) -> None:
    for a, b in zip(result.outputs[0], result.outputs[1]):
        for name in a["local"]:
            assert torch.equal(a["local"][name], b["local"][name]), name


def test_groups_meet_every_sync_every_steps_as_local_sgd_by_hand(tmp_path: Path) -> None:
    # The group healing at step 0 fetches its checkpoint 2 s late (a loaded machine): the healthy group goes on
    # serving it rather than closing its server at its first commit (which lost the healing group's steps).
    result = run_replica_groups(slow_healing_replica_rank, 2, 2, "pipeline 2", 9, (), FT, str(tmp_path),
                                timeout=240)
    _equal_groups(result)  # step 9 is a meeting
    records = recorded(tmp_path, 2)
    assert [[r["step"] for r in group] for group in records] == [list(range(9))] * 2
    reference = local_sgd_reference(records, sync_every=3)
    full = {}
    for out in result.outputs[0]:
        full.update(out["full"])
    gap = max(float((full[k] - reference[k]).abs().max()) for k in reference)
    print(f"local_sgd parity: {gap:.2e}")
    assert gap < 1e-5


# 90 s, and its 60 s start-up wait is load-sensitive: DiLoCo's killed-group test holds the rejoin by default.
@pytest.mark.extended
def test_a_killed_group_rejoins_local_sgd_at_the_next_meeting(tmp_path: Path) -> None:
    steps = 15
    result = run_replica_groups(replica_rank, 2, 2, "pipeline 2", steps, (fail_at(1, 0, 4),), FT, str(tmp_path),
                                timeout=300, restart_delay=3.0)
    assert result.restarts == [0, 1], result.failures
    assert [r["step"] for r in recorded(tmp_path, 2)[0]] == list(range(steps))  # the survivor never stopped
    rejoined = result.outputs[1][0]["records"]
    assert rejoined and rejoined[0]["step"] % 3 == 0 and rejoined[0]["step"] > 4, rejoined[0]["step"]
    assert all(out["global_step"] == steps for group in result.outputs for out in group)
    _equal_groups(result)  # step 15 is a meeting
