"""A replica group lost mid-run: the others train on, it comes back with a healthy peer's state, and the run
equals one process taking the same committed steps on the same batches.

Tolerance: the groups average two fp32 gradients through gloo where the reference takes one mean over the joined
batch; AdamW then divides by sqrt(v), which turns rounding in a near-zero gradient into an lr-sized step.
Measured: parameters within 1.2e-6..1.7e-6 and losses within 6e-8..9e-8 over 6 and 24 steps; the bound below is
1e-5 for both (the issue's bound for runs without a failure).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_parallel.testing.faults import fail_at, hang_at
from lightning_parallel.testing.replica_groups import run_replica_groups
from tests.distributed.fault_tolerance.replica_runs import recorded, reference_run, replica_rank

pytest.importorskip("torchft")

FT = {"timeout": 10, "quorum_timeout": 60, "connect_timeout": 5}
TOL = 1e-5


def _merged(outputs: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for out in outputs:
        merged.update(out[key])
    return merged


def _check_against_reference(result, steps: int, folder: Path) -> tuple[float, float]:
    records = recorded(folder, len(result.outputs))
    reference, losses = reference_run(records, replicas=len(records))
    full = _merged(result.outputs[0], "full")
    assert full.keys() == reference.keys()
    param_gap = max(float((full[k] - reference[k]).abs().max()) for k in reference)
    loss_gap = max(abs(r["loss"] - loss) for r, loss in zip(records[0], losses))
    print(f"fault tolerance parity: parameters {param_gap:.2e}, losses {loss_gap:.2e} over {len(records[0])} steps")
    assert param_gap < TOL and loss_gap < TOL, (param_gap, loss_gap)
    for out in result.outputs[0]:
        assert out["global_step"] == steps
    return param_gap, loss_gap


def _groups_equal_bit_for_bit(result) -> None:
    """Same weights, and the same place in the run: what every checkpoint either group writes now claims (committed
    steps, epoch, batch of the epoch, batches in all, logged steps, the loader's position)."""
    for a, b in zip(result.outputs[0], result.outputs[1]):
        assert (a["global_step"], a["epoch"], a["loop"]) == (b["global_step"], b["epoch"], b["loop"])
        assert a["local"].keys() == b["local"].keys()
        for name in a["local"]:
            assert torch.equal(a["local"][name], b["local"][name]), name


def test_two_groups_without_a_failure_equal_one_process_on_the_joined_batches(tmp_path: Path) -> None:
    result = run_replica_groups(replica_rank, 2, 2, "pipeline 2", 6, (), FT, str(tmp_path), timeout=240)
    assert result.restarts == [0, 0]
    _groups_equal_bit_for_bit(result)
    assert all(r["participants"] == 2 for r in result.outputs[0][0]["records"])
    _check_against_reference(result, 6, tmp_path)


@pytest.mark.parametrize(("layout", "fault"), [("pipeline 2", fail_at(replica=1, rank=0, step=5)),
                                               ("tensor 2", fail_at(replica=1, rank=0, step=5)),
                                               pytest.param("pipeline 2", hang_at(replica=1, rank=1, step=5),
                                                            marks=pytest.mark.extended),  # 20 s; time budget
                                               # rank 0 hung: its peers wait in monitored_barrier's send/recv, bounded
                                               # by the liveness group's own timeout (issue 43: else 30 min, and the
                                               # healthy group stopped, finding no quorum)
                                               ("pipeline 2", hang_at(replica=1, rank=0, step=5))],  # 12 s
                         ids=["pipeline 2, killed", "tensor 2, killed", "pipeline 2, hung", "pipeline 2, rank 0 hung"])
def test_a_lost_group_rejoins_from_a_healthy_peer_and_the_run_matches_its_committed_steps(layout, fault, tmp_path):
    steps = 24
    ft = {**FT, "group_timeout": 5} if fault.kind == "hang" else FT  # the hung group stops after 5 s
    result = run_replica_groups(replica_rank, 2, 2, layout, steps, (fault,), ft, str(tmp_path),
                                timeout=400, restart_delay=3.0)
    assert result.restarts == [0, 1], result.failures
    assert len(result.failures[1]) == 1
    survivor = recorded(tmp_path, 2)[0]
    assert [r["step"] for r in survivor] == list(range(steps))  # the healthy group never stopped
    alone = [r["step"] for r in survivor if r["participants"] == 1]
    assert alone and alone[0] == 5, alone  # it trained on without the lost group
    rejoined = result.outputs[1][0]["records"]
    assert rejoined and rejoined[0]["step"] > 5 and rejoined[0]["participants"] == 2
    _groups_equal_bit_for_bit(result)
    _check_against_reference(result, steps, tmp_path)
