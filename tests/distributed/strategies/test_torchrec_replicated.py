"""Replicated (``data_parallel``) TorchRec tables train with the model's own table optimizer, and the logged
``train_loss`` is the global batch's (issue 39).

DLRM recipe, fp32, 2 processes, the same 32-sample global batches for 4 steps. TorchRec fuses no optimizer into a
replicated table; the strategy gives it the dense twin of its fused optimizer. Each table's update (final minus
initial weights, gathered from every rank's shards) under ``data_parallel`` -- all tables, or mixed with
table-wise and column-wise ones -- equals the table-wise run's and one process's fused update within 1e-5, for
Adagrad (lr 0.05) and row-wise Adagrad. The negative control replicates the tables without the twin, as before
the fix: the dense Adam (1e-3) of ``configure_optimizers`` updates them, which the comparison must catch.

The logged ``train_loss`` (``trainer.callback_metrics`` after each step) at 2 ranks equals one process's on the
same global batch within 1e-5; a rank's own loss (what was logged before) does not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import DistributedRunError, run_processes  # noqa: E402

TOL = 1e-5
STEPS = 4
GLOBAL_BATCH = 32
TABLE_SIZES = (200, 100, 32, 16)
DIM = 8
MIXED = {"t_0": "table_wise", "t_1": "data_parallel", "t_2": "column_wise", "t_3": "data_parallel"}


def _local_tables(module) -> dict[str, list]:
    """``{table: [(rows, columns, values)]}`` of the pieces of every table this rank holds."""
    from lightning_parallel.adapters.torchrec import _local_regions

    pieces: dict[str, list] = {}
    for key, value in module.state_dict().items():
        if ".embedding_bags." in key:  # <collection>.embedding_bags.<table>.weight, sharded or not
            table = key.split(".embedding_bags.")[1].split(".")[0]
            pieces[table] = [(rows, cols, t.detach().clone()) for t, rows, cols in _local_regions(value)]
    return pieces


def _strategy(case: dict):
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

    if case.get("lightning"):
        return case["lightning"]  # Lightning's own strategy: the recipe must not need the suite's

    class DenseOptimizerTables(TorchRecStrategy):
        """Negative control: replicated tables left to the dense optimizer, as before the fix."""

        def _shard(self, *args):
            dmp = super()._shard(*args)
            self.replicated_tables = None
            return dmp

    kind = DenseOptimizerTables if case.get("control") else TorchRecStrategy
    return kind(sharding=case["sharding"], column_shard_dim=case.get("column_shard_dim"))


def fit_dlrm(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict]:
    """Fit the recipe for each case; return its tables before and after, and its losses (global, logged, own)."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    class Record(pl.Callback):
        def on_train_start(self, trainer, module):
            self.initial = _local_tables(module)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.logged.append(float(trainer.callback_metrics["train_loss"]))

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        optimizer = case.get("optimizer", "adagrad")
        model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=DIM, table_optimizer=optimizer, table_lr=0.05)
        data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=STEPS * GLOBAL_BATCH, val_samples=16,
                                   batch_size=GLOBAL_BATCH // world_size, shuffle=False)
        history, record = LossHistory(), Record()
        record.logged = []
        trainer = quiet_trainer(world_size, _strategy(case), STEPS, [history, record], limit_val_batches=0)
        trainer.fit(model, datamodule=data)
        results[name] = {"initial": record.initial, "final": _local_tables(model), "losses": history.losses,
                         "logged": record.logged, "own": history.local_losses,
                         "types": {r.table: r.sharding_type for r in getattr(trainer.strategy, "plan_table", [])}}
    return results


def _whole(per_rank: list[dict], name: str, when: str) -> dict:
    """Every table of case ``name`` assembled from all ranks' pieces (replicas must agree)."""
    import torch

    tables = {}
    for table, rows in zip([f"t_{j}" for j in range(len(TABLE_SIZES))], TABLE_SIZES):
        whole = torch.full((rows, DIM), float("nan"))
        for results in per_rank:
            for (r0, r1), (c0, c1), values in results[name][when][table]:
                region = whole[r0:r1, c0:c1]
                assert torch.isnan(region).all() or torch.equal(region, values), f"{name}: replicas of {table} differ"
                region.copy_(values)
        assert not torch.isnan(whole).any(), f"{name}: {table} not covered by the ranks' pieces"
        tables[table] = whole
    return tables


def _updates(per_rank: list[dict], name: str) -> dict:
    initial, final = _whole(per_rank, name, "initial"), _whole(per_rank, name, "final")
    return {table: final[table] - initial[table] for table in final}


def _largest_difference(a: dict, b: dict) -> float:
    return max(float((a[t] - b[t]).abs().max()) for t in a)


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    """One process (fused tables) and 2 processes (table-wise, replicated, mixed, the control)."""
    one = {"table_wise": {"sharding": "table_wise"},
           "rowwise/table_wise": {"sharding": "table_wise", "optimizer": "rowwise_adagrad"},
           "lightning/auto": {"lightning": "auto"}}
    two = {"table_wise": {"sharding": "table_wise"},
           "data_parallel": {"sharding": "data_parallel"},
           "mixed": {"sharding": MIXED, "column_shard_dim": DIM // 2},
           "rowwise/data_parallel": {"sharding": "data_parallel", "optimizer": "rowwise_adagrad"},
           "control/dense_optimizer": {"sharding": "data_parallel", "control": True}}
    reference = run_processes(fit_dlrm, 1, one, timeout=300)
    return reference, run_processes(fit_dlrm, 2, two, timeout=600)


def test_replicated_tables_update_as_the_fused_optimizer(runs):
    reference, per_rank = runs
    assert per_rank[0]["data_parallel"]["types"] == dict.fromkeys(per_rank[0]["data_parallel"]["types"],
                                                                   "data_parallel")
    assert per_rank[0]["mixed"]["types"] == MIXED
    fused = _updates(reference, "table_wise")
    assert min(float(u.abs().max()) for u in fused.values()) > 1e-2  # every table really moved
    differences = {}
    for name, against in (("table_wise", "table_wise"), ("data_parallel", "table_wise"), ("mixed", "table_wise"),
                          ("rowwise/data_parallel", "rowwise/table_wise")):
        differences[name] = _largest_difference(_updates(per_rank, name), _updates(reference, against))
    differences["data_parallel vs table_wise, 2 ranks"] = _largest_difference(
        _updates(per_rank, "data_parallel"), _updates(per_rank, "table_wise"))
    print("max |table update - one process's fused update|:", differences)
    assert max(differences.values()) < TOL, differences
    control = _largest_difference(_updates(per_rank, "control/dense_optimizer"), fused)
    print(f"negative control (replicated tables on the dense Adam 1e-3): {control:.3e}")
    assert control > 100 * TOL


def test_logged_train_loss_is_the_global_batch_mean(runs):
    reference, per_rank = runs
    one_process = reference[0]["table_wise"]["logged"]
    assert len(one_process) == STEPS
    logged = [max(abs(a - b) for a, b in zip(results["table_wise"]["logged"], one_process)) for results in per_rank]
    own = [max(abs(a - b) for a, b in zip(results["table_wise"]["own"], one_process)) for results in per_rank]
    print(f"max |logged train_loss - one process| per rank {logged}; a rank's own loss: {own}")
    assert max(logged) < TOL
    assert min(own) > TOL  # what rank 0 logged before: its half of the batch
    # The recipe logs the same under Lightning's own single-device strategy (tables whole, optimizer in backward).
    lightning = max(abs(a - b) for a, b in zip(reference[0]["lightning/auto"]["logged"], one_process))
    print(f"Lightning's own strategy (one device) vs strategy=torchrec: {lightning:.2e}")
    assert lightning < TOL


def test_a_replicated_table_without_an_exact_twin_is_refused_before_sharding():
    with pytest.raises(DistributedRunError, match="Table 't_0' is data_parallel.*Adam.*table_wise"):
        run_processes(fit_dlrm, 1, {"adam": {"sharding": "data_parallel", "optimizer": "adam"}}, timeout=300)
