"""DLRM under ``strategy=torchrec`` on 2 and 4 processes reaches the one-process held-out AUC within 0.002 after the
same number of samples, table-wise and column-wise (issue 32).

fp32, the same global batches in the same order (Zipf click log, no shuffling), the same number of steps: Adagrad
fused into the tables, Adam on the dense part. After training, the recipe's own evaluation
(:class:`~lightning_parallel.callbacks.EvaluationReport` with the model's ``evaluation_metrics``, a
``BinaryAUROC``) scores the whole held-out split on every rank; the test checks that each rank's metric saw every
held-out sample and that all ranks agree, then compares the AUC with one process. The one-process AUC must be
clearly above chance, so the comparison is between models that learned.

The held-out split is cut from the same draw as the training split (``ZipfClickDataModule``; a separate draw
redrew the click model with the log, and the same training scored 0.57 there).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import run_processes  # noqa: E402
from tests.distributed.strategies.test_torchrec_parity import _strategy  # noqa: E402  (its negative control too)

TOL = 0.002
# Held-out AUC: about 0.55 after one step, 0.715 after these 48; the click model's own logits score 0.849 (Bayes).
LEARNED = 0.65
STEPS = 48
GLOBAL_BATCH = 64
VAL_SAMPLES = 2048
TABLE_SIZES = (1000, 500, 64, 32)
DIM = 16


def _held_out_data(world_size: int, steps: int, val_samples: int):
    """The recipe's data module: its validation split held out from the training draw (one click model for both)."""
    from examples.recsys.torchrec_data import ZipfClickDataModule

    return ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=steps * GLOBAL_BATCH, val_samples=val_samples,
                               batch_size=GLOBAL_BATCH // world_size, shuffle=False)


def fit_and_score(rank: int, world_size: int, cases: dict[str, dict], steps: int = STEPS,
                  val_samples: int = VAL_SAMPLES) -> dict[str, dict]:
    """Fit the TorchRec DLRM recipe for each case; return its held-out AUC, how many samples the metric scored,
    and its global-batch losses."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.callbacks import EvaluationReport
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        optimizer, lr = case.get("table_optimizer", ("adagrad", 0.05))
        model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=DIM, table_optimizer=optimizer, table_lr=lr)
        made = []  # the metrics the report builds, to count what they scored
        model.evaluation_metrics = lambda factory=model.evaluation_metrics: made.append(factory()) or made[-1]
        report, history = EvaluationReport(latency_batches=0, splits=("val",), print_table=False), LossHistory()
        strategy = _strategy(case)
        trainer = quiet_trainer(world_size, strategy, steps, [history, report], limit_val_batches=0)
        trainer.fit(model, datamodule=_held_out_data(world_size, steps, val_samples))
        auc = made[-1]["auc"]
        results[name] = {"auc": report.summary["eval/val_auc"], "scored": sum(len(p) for p in auc.preds),
                         "losses": history.losses, "types": sorted({r.sharding_type for r in strategy.plan_table}),
                         "ranks": sorted({len(r.ranks) for r in strategy.plan_table})}
    return results


SGD = ("sgd", 2.0)  # the negative control's tables: Adagrad's step does not change when every gradient is scaled


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict]:
    """One process, every table whole on rank 0: the reference runs (Adagrad tables; SGD tables for the control)."""
    cases = {"adagrad": {"sharding": "table_wise"}, "sgd": {"sharding": "table_wise", "table_optimizer": SGD}}
    return run_processes(fit_and_score, 1, cases, timeout=300)[0]


def _held_out_auc(per_rank: list[dict], name: str) -> float:
    """Every rank trained on as many samples as one process, scored the whole held-out split and got the same
    AUC; return it."""
    aucs = [results[name]["auc"] for results in per_rank]
    assert all(len(results[name]["losses"]) == STEPS for results in per_rank), name
    assert all(results[name]["scored"] == VAL_SAMPLES for results in per_rank), name
    assert max(aucs) - min(aucs) < 1e-6, f"{name}: ranks disagree on the held-out AUC {aucs}"
    return aucs[0]


@pytest.mark.slow
# 4 ranks repeat the AUC claim with `pytest -m extended` (9 s here; the suite's time budget): the default run holds
# 4-rank table- and column-wise parity in test_torchrec_parity.py and the 2-rank AUC here.
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_table_and_column_wise_reach_one_process_auc(world_size, one_process):
    reference = one_process["adagrad"]
    assert reference["scored"] == VAL_SAMPLES
    assert reference["auc"] > LEARNED, f"one process did not learn: held-out AUC {reference['auc']:.4f}"
    cases = {"table_wise": {"sharding": "table_wise"},
             "column_wise": {"sharding": "column_wise", "column_shard_dim": DIM // world_size}}
    if world_size == 2:
        cases["control/undivided"] = {"sharding": "table_wise", "table_optimizer": SGD, "control": True}
    per_rank = run_processes(fit_and_score, world_size, cases, timeout=600)
    # The plans are what they claim: whole tables on single ranks; column-wise tables split over every rank.
    assert per_rank[0]["table_wise"]["types"] == ["table_wise"] and per_rank[0]["table_wise"]["ranks"] == [1]
    assert per_rank[0]["column_wise"]["types"] == ["column_wise"]
    assert per_rank[0]["column_wise"]["ranks"] == [world_size]
    differences = {}
    for name in ("table_wise", "column_wise"):
        auc = _held_out_auc(per_rank, name)
        differences[name] = abs(auc - reference["auc"])
        assert differences[name] <= TOL, f"{name}: held-out AUC {auc:.5f} vs one process {reference['auc']:.5f}"
    print(f"world {world_size}: one-process AUC {reference['auc']:.5f}; |AUC - one process|:", differences)
    if world_size == 2:  # the tolerance catches a real fault: tables learning twice too fast move the AUC
        control = abs(_held_out_auc(per_rank, "control/undivided") - one_process["sgd"]["auc"])
        assert control > TOL, f"the negative control stayed within {TOL} of one process ({control:.5f})"
        print(f"world 2: negative control |AUC - one process (SGD tables)| = {control:.5f}")
