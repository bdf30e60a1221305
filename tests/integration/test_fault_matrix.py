"""The fault matrix's fast sample (the whole: ``python -m benchmarks.fault_matrix``, docs/fault-matrix.md): under
pipeline 2, a rank killed in backward, hung before the optimizer step, SIGTERM'd in forward, and the checkpoint
being resumed truncated: every trial ends within the timeout with a clear error or a stop, and the run resumed from
the checkpoint the resume logic picks gives the uninterrupted run's losses."""

import pytest

from benchmarks.fault_matrix import Trial, reference_run, run_trial
from benchmarks.fault_matrix_report import totals

pytestmark = pytest.mark.slow
TIMEOUT_S = 5.0


def test_pipeline_faults_stop_clearly_and_resume_to_the_uninterrupted_losses(tmp_path):
    reference = reference_run("pipeline", tmp_path, TIMEOUT_S)
    pairs = [("kill", "backward"), ("hang", "optimizer_step"), ("sigterm", "forward"), ("truncate", "resume")]
    rows = {fault: run_trial(Trial("pipeline", fault, moment), tmp_path, TIMEOUT_S, reference)
            for fault, moment in pairs}
    assert {fault: row["outcome"] for fault, row in rows.items()} == {
        "kill": "stopped, resumed", "hang": "stopped, resumed", "sigterm": "stopped, resumed", "truncate": "refused"}
    assert "rank 1 died" in rows["kill"]["error"] and "rank 1 is in optimizer_step of step 5 too but did not time out: stuck inside it" in rows["hang"]["error"]
    assert rows["hang"]["detect_s"] < TIMEOUT_S + 5
    assert rows["kill"]["lost"] == 1 and rows["sigterm"]["lost"] == 0
    assert "Reading the checkpoint" in rows["truncate"]["error"] and "last.ckpt failed" in rows["truncate"]["error"]
    assert totals(list(rows.values()))["failures"] == {"HANG": 0, "CORRUPT LATEST": 0, "SILENT": 0, "UNCLEAR": 0}
