"""DLRM under ``strategy=torchrec`` on 2 and 4 processes matches one process: table-wise and column-wise (and
table-column-wise and data-parallel, the other types TorchRec runs on gloo).

fp32, the same global batch (32 samples of multi-hot Zipf ids), 8 steps: Adagrad (and SGD) fused into TorchRec's
table kernels, Adam on the dense part from ``configure_optimizers``. Every rank's global-batch losses are within
1e-5 of one process under the same strategy (where every table is whole on rank 0), data-parallel tables too: they
keep the tables' Adagrad (a dense twin, as TorchRec fuses nothing into a replicated table). The negative control turns
off TorchRec's division of table gradients by the world size, so each table learns W times too fast: the test
must see it. It runs with SGD tables: Adagrad's step does not change when every gradient is scaled.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import max_abs_difference, run_processes  # noqa: E402

TOL = 1e-5
STEPS = 8
GLOBAL_BATCH = 32
TABLE_SIZES = (1000, 500, 64, 32)


def _strategy(case: dict):
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

    class UndividedTableGradients(TorchRecStrategy):
        """Negative control: table gradients are summed over ranks instead of averaged."""

        def setup(self, trainer):
            from torchrec.distributed.comm_ops import set_gradient_division

            set_gradient_division(False)
            super().setup(trainer)

        def teardown(self):
            from torchrec.distributed.comm_ops import set_gradient_division

            set_gradient_division(True)
            super().teardown()

    kind = UndividedTableGradients if case.get("control") else TorchRecStrategy
    return kind(sharding=case["sharding"], column_shard_dim=case.get("column_shard_dim"))


def fit_dlrm(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Fit the TorchRec DLRM recipe for each case; return its global-batch losses (and the plan's rows)."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        optimizer, lr = case.get("table_optimizer", ("adagrad", 0.05))
        model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer=optimizer, table_lr=lr)
        data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=STEPS * GLOBAL_BATCH, val_samples=64,
                                   batch_size=GLOBAL_BATCH // world_size, shuffle=False)
        history = LossHistory()
        strategy = _strategy(case)
        trainer = quiet_trainer(world_size, strategy, STEPS, [history], limit_val_batches=0)
        trainer.fit(model, datamodule=data)
        assert len(history.losses) == STEPS
        results[name] = {"losses": history.losses, "types": sorted({r.sharding_type for r in strategy.plan_table}),
                         "ranks": sorted({len(r.ranks) for r in strategy.plan_table})}
    return results


SGD = ("sgd", 0.5)


def _reference() -> dict[str, list[float]]:
    """One process, every table whole on rank 0: ``adagrad`` and ``sgd`` tables (fused)."""
    cases = {"adagrad": {"sharding": "table_wise"}, "sgd": {"sharding": "table_wise", "table_optimizer": SGD}}
    return {name: r["losses"] for name, r in run_processes(fit_dlrm, 1, cases, timeout=300)[0].items()}


def _check(per_rank: list[dict], reference: dict[str, list[float]], names: list[str]) -> dict[str, float]:
    worst = {}
    for name in names:
        ref = reference["sgd" if "sgd" in name or "control" in name else "adagrad"]
        diffs = [max_abs_difference(results[name]["losses"], ref) for results in per_rank]
        worst[name] = max(diffs)
        assert worst[name] < TOL, f"{name}: max |loss - one process| per rank {diffs}"
    return worst


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_table_and_column_wise_match_one_process(world_size):
    cases = {
        "table_wise": {"sharding": "table_wise"},
        "column_wise": {"sharding": "column_wise", "column_shard_dim": 16 // world_size},
        "sgd/table_wise": {"sharding": "table_wise", "table_optimizer": SGD},
        "table_column_wise": {"sharding": "table_column_wise", "column_shard_dim": 8},
        "data_parallel": {"sharding": "data_parallel"},
        "control/undivided": {"sharding": "table_wise", "table_optimizer": SGD, "control": True},
    }
    per_rank = run_processes(fit_dlrm, world_size, cases, timeout=600)
    reference = _reference()
    # The plans really are what they claim: one type, and column-wise tables split over every rank.
    assert per_rank[0]["table_wise"]["types"] == ["table_wise"] and per_rank[0]["table_wise"]["ranks"] == [1]
    assert per_rank[0]["column_wise"]["types"] == ["column_wise"]
    assert per_rank[0]["column_wise"]["ranks"] == [world_size]
    names = ["table_wise", "column_wise", "sgd/table_wise", "table_column_wise", "data_parallel"]
    print(f"world {world_size}: max |diff| per case:", _check(per_rank, reference, names))
    with pytest.raises(AssertionError, match="control/undivided") as failure:
        _check(per_rank, reference, ["control/undivided"])
    print(f"world {world_size}: negative control:", failure.value.args[0].split(": ", 1)[1])
