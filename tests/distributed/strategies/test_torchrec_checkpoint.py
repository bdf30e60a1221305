"""A DCP checkpoint of ``strategy=torchrec`` resumes under another world size and plan, continuing the
uninterrupted losses.

2 ranks table-wise train 4 steps -- one epoch, or half of one -- and save (sharded tables, fused Adagrad state,
dense Adam state); 4 ranks column-wise -- every table split over every rank -- resume and train to step 8 (with
:class:`~lightning_parallel.callbacks.ExactDataResume`; the suite's loader keeps its place in the global sample
stream, so a mid-epoch checkpoint continues on the same samples at another world size). Their losses equal steps
5-8 of one uninterrupted 2-rank run within 1e-5, and so do one process's (2 -> 1). The negative control resumes
the same way but starts the tables' optimizer afresh (Adagrad's sums zeroed), which the comparison must catch.

The tables' optimizer state itself is compared too, gathered from every rank's pieces: Adagrad's sums saved by 2
ranks (table-wise, or replicated tables with their dense twins) are what 4 ranks column-wise and one process
(table-wise, or replicated) hold once the checkpoint is loaded, exactly.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import max_abs_difference, run_processes  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-5
GLOBAL_BATCH = 32
TABLE_SIZES = (1000, 500, 64, 32)
EPOCH_STEPS = 4


def fit_dlrm(rank: int, world_size: int, sharding: str, steps: int, save_to: str | None = None,
             resume_from: str | None = None, column_shard_dim: int | None = None,
             reset_table_optimizer: bool = False, epoch_steps: int = EPOCH_STEPS) -> list[float]:
    """Train the TorchRec DLRM recipe to ``steps`` (from ``resume_from`` if given); save to ``save_to`` if given."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.callbacks import ExactDataResume
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    pl.seed_everything(0)
    model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer="adagrad", table_lr=0.05)
    data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=epoch_steps * GLOBAL_BATCH, val_samples=64,
                               batch_size=GLOBAL_BATCH // world_size, shuffle=False)
    history = LossHistory()
    strategy = TorchRecStrategy(sharding=sharding, column_shard_dim=column_shard_dim)
    trainer = quiet_trainer(world_size, strategy, steps, [history, ExactDataResume()], limit_val_batches=0)
    if reset_table_optimizer:
        original = strategy.load_checkpoint

        def load_then_reset(*args, **kwargs):
            metadata = original(*args, **kwargs)
            for value in strategy.model.fused_optimizer.state_dict()["state"].values():
                for tensor in value.values():
                    for shard in tensor.local_shards():
                        shard.tensor.zero_()
            return metadata

        strategy.load_checkpoint = load_then_reset
    trainer.fit(model, datamodule=data, ckpt_path=resume_from)
    if save_to:
        trainer.save_checkpoint(save_to)
    return history.losses


# Saved at an epoch's end repeats the claim with `pytest -m extended` (10 s here; the suite's time budget): saved
# mid-epoch, the default cell, reshards the same tables and also restores the loader's place in the epoch.
@pytest.mark.parametrize("epoch_steps", [pytest.param(EPOCH_STEPS, marks=pytest.mark.extended), 2 * EPOCH_STEPS],
                         ids=["epoch_end", "mid_epoch"])
def test_resume_on_four_ranks_column_wise_continues_a_two_rank_table_wise_run(tmp_path, epoch_steps):
    path, run = str(tmp_path / "step4.ckpt"), {"epoch_steps": epoch_steps, "timeout": 300}
    uninterrupted = run_processes(fit_dlrm, 2, "table_wise", 8, **run)[0]
    first = run_processes(fit_dlrm, 2, "table_wise", EPOCH_STEPS, save_to=path, **run)[0]
    assert max_abs_difference(first, uninterrupted[:EPOCH_STEPS]) < TOL
    resumed = run_processes(fit_dlrm, 4, "column_wise", 8, resume_from=path, column_shard_dim=4, **run)
    one = run_processes(fit_dlrm, 1, "table_wise", 8, resume_from=path, **run)[0]
    diffs = [max_abs_difference(losses, uninterrupted[EPOCH_STEPS:]) for losses in resumed]
    print(f"{epoch_steps}-step epoch, resumed 4 x column_wise vs uninterrupted 2 x table_wise: max |diff| per rank "
          f"{diffs}; on one process: {max_abs_difference(one, uninterrupted[EPOCH_STEPS:]):.2e}")
    assert max(diffs) < TOL, diffs
    assert len(one) == 8 - EPOCH_STEPS and max_abs_difference(one, uninterrupted[EPOCH_STEPS:]) < TOL
    if epoch_steps != EPOCH_STEPS:
        return
    control = run_processes(fit_dlrm, 4, "column_wise", 8, resume_from=path, column_shard_dim=4,
                            reset_table_optimizer=True, **run)[0]
    control_diff = max_abs_difference(control, uninterrupted[EPOCH_STEPS:])
    print(f"negative control (table optimizer state dropped): {control_diff:.2e}")
    assert control_diff > TOL


def table_optimizer_states(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict]:
    """For each case, train (from its ``resume_from`` if given) and save if asked; return the pieces of the tables'
    optimizer state this rank holds when training starts (after a load: as loaded) and when it ends."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.adapters.torchrec import _local_regions
    from lightning_parallel.callbacks import ExactDataResume
    from lightning_parallel.strategies.torchrec.replicated import TableOptimizers
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy
    from lightning_parallel.testing.fit import quiet_trainer

    def pieces(strategy) -> dict[str, list]:
        state = TableOptimizers(strategy.dmp.fused_optimizer, strategy.replicated_tables).state_dict()["state"]
        return {key: [(rows, cols, t.detach().clone()) for t, rows, cols in _local_regions(value)]
                for per_table in state.values() for key, value in per_table.items()}

    class Record(pl.Callback):
        def on_train_start(self, trainer, module):
            self.start = pieces(trainer.strategy)

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer="adagrad", table_lr=0.05)
        data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=EPOCH_STEPS * GLOBAL_BATCH,
                                   val_samples=64, batch_size=GLOBAL_BATCH // world_size, shuffle=False)
        strategy = TorchRecStrategy(sharding=case["sharding"], column_shard_dim=case.get("column_shard_dim"))
        record = Record()
        trainer = quiet_trainer(world_size, strategy, case["steps"], [record, ExactDataResume()],
                                limit_val_batches=0)
        trainer.fit(model, datamodule=data, ckpt_path=case.get("resume_from"))
        if case.get("save_to"):
            trainer.save_checkpoint(case["save_to"])
        results[name] = {"start": record.start, "end": pieces(strategy)}
    return results


def _whole_states(per_rank: list[dict], name: str, when: str) -> dict:
    """Every ``<table>.momentum1`` of case ``name`` assembled from all ranks' pieces."""
    import torch

    whole: dict = {}
    for results in per_rank:
        for key, regions in results[name][when].items():
            for (r0, r1), (c0, c1), values in regions:
                rows = max(r1, whole[key].shape[0]) if key in whole else r1
                cols = max(c1, whole[key].shape[1]) if key in whole else c1
                grown = torch.zeros(rows, cols)
                if key in whole:
                    grown[:whole[key].shape[0], :whole[key].shape[1]] = whole[key]
                grown[r0:r1, c0:c1] = values
                whole[key] = grown
    return whole


def _state_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_table_optimizer_state_is_resharded_exactly(tmp_path):
    table_wise, replicated = str(tmp_path / "table_wise.ckpt"), str(tmp_path / "replicated.ckpt")
    saved = run_processes(table_optimizer_states, 2, {
        "table_wise": {"sharding": "table_wise", "steps": EPOCH_STEPS, "save_to": table_wise},
        "replicated": {"sharding": "data_parallel", "steps": EPOCH_STEPS, "save_to": replicated}}, timeout=300)
    four = run_processes(table_optimizer_states, 4, {
        "from table_wise": {"sharding": "column_wise", "column_shard_dim": 4, "steps": EPOCH_STEPS + 1,
                            "resume_from": table_wise},
        "from replicated": {"sharding": "column_wise", "column_shard_dim": 4, "steps": EPOCH_STEPS + 1,
                            "resume_from": replicated}}, timeout=300)
    one = run_processes(table_optimizer_states, 1, {
        "from table_wise": {"sharding": "table_wise", "steps": EPOCH_STEPS + 1, "resume_from": table_wise},
        "replicated from table_wise": {"sharding": "data_parallel", "steps": EPOCH_STEPS + 1,
                                       "resume_from": table_wise}}, timeout=300)
    sums = {name: _whole_states(saved, name, "end") for name in ("table_wise", "replicated")}
    largest = max(float(v.abs().max()) for v in sums["table_wise"].values())
    assert min(float(v.abs().max()) for v in sums["table_wise"].values()) > 0  # every table's sums grew
    differences = {
        "saved: replicated vs table_wise": _state_difference(sums["replicated"], sums["table_wise"]),
        "2 table_wise -> 4 column_wise": _state_difference(_whole_states(four, "from table_wise", "start"),
                                                           sums["table_wise"]),
        "2 replicated -> 4 column_wise": _state_difference(_whole_states(four, "from replicated", "start"),
                                                           sums["replicated"]),
        "2 table_wise -> 1 table_wise": _state_difference(_whole_states(one, "from table_wise", "start"),
                                                          sums["table_wise"]),
        "2 table_wise -> 1 replicated": _state_difference(_whole_states(one, "replicated from table_wise", "start"),
                                                          sums["table_wise"]),
    }
    print(f"max |Adagrad sum - saved| (largest sum {largest:.2e}):", differences)
    # Sums of squared gradients are about 1e-6 here: the twins' agree with the fused ones relatively.
    assert differences.pop("saved: replicated vs table_wise") < 1e-4 * largest
    assert max(differences.values()) == 0.0, differences  # a load copies: nothing is recomputed
