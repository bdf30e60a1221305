"""The lighthouse lost mid-run (issue 43's fault matrix; ``benchmarks/fault_replicas.py``, docs/fault-matrix.md).

Two replica groups of one process each (the residual MLP, AdamW). The lighthouse is shut down once group 0 has
committed 5 steps (the supervisor notices within a few steps: at least 20 of the 60 come after). While no group
comes or goes, the groups need no new quorum: they train on to the last step, equal to one process taking the same
committed steps on the same batches. When a group is then lost as well, the restarted group cannot reach the
lighthouse and the run stops with an error naming it -- within the connect timeout, not a hang.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fault_replicas import TOLERANCE, run_trial

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow


def test_the_groups_train_on_without_the_lighthouse_to_one_process_numbers(tmp_path: Path) -> None:
    row = run_trial("one", "lighthouse lost", 60, tmp_path)
    print(row)
    assert row["lighthouse_lost_at"] is not None and row["lighthouse_lost_at"] < 40, row  # lost mid-run
    assert row["outcome"] == "trained on" and row["restarts"] == [0, 0] and row["max_diff"] <= TOLERANCE, row


@pytest.mark.extended
def test_a_group_lost_after_the_lighthouse_stops_the_run_with_an_error_naming_it(tmp_path: Path) -> None:
    row = run_trial("one", "lighthouse lost then a group killed", 24, tmp_path)
    print(row)
    assert row["outcome"] == "stopped, clear error", row
    assert "the lighthouse at http" in row["error"] and "is not reachable within 5 s" in row["error"]
    assert row["detect_s"] < 30, row  # the restarted group's connect timeout (5 s) after the restart delay (3 s)
