"""A DCP checkpoint of ``strategy=torchrec`` resumes under another world size and plan, continuing the
uninterrupted losses.

2 ranks table-wise train 4 steps -- one epoch -- and save (sharded tables, fused Adagrad state, dense Adam state);
4 ranks column-wise -- every table split over every rank -- resume and train to step 8. The checkpoint is taken at
an epoch's end (with :class:`~lightning_parallel.callbacks.ExactDataResume`): the suite's loader records the
position of a rank within its shard, which a mid-epoch checkpoint cannot carry to another world size. Their losses
equal steps 5-8 of one uninterrupted 2-rank run within 1e-5. The negative control resumes the same way but starts
the tables' optimizer afresh (Adagrad's sums zeroed), which the comparison must catch.
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
             reset_table_optimizer: bool = False) -> list[float]:
    """Train the TorchRec DLRM recipe to ``steps`` (from ``resume_from`` if given); save to ``save_to`` if given."""
    import lightning.pytorch as pl

    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.callbacks import ExactDataResume
    from lightning_parallel.strategies.torchrec import TorchRecStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    pl.seed_everything(0)
    model = TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer="adagrad", table_lr=0.05)
    data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=EPOCH_STEPS * GLOBAL_BATCH, val_samples=64,
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


def test_resume_on_four_ranks_column_wise_continues_a_two_rank_table_wise_run(tmp_path):
    path = str(tmp_path / "step4.ckpt")
    uninterrupted = run_processes(fit_dlrm, 2, "table_wise", 8, timeout=300)[0]
    first = run_processes(fit_dlrm, 2, "table_wise", EPOCH_STEPS, save_to=path, timeout=300)[0]
    assert max_abs_difference(first, uninterrupted[:EPOCH_STEPS]) < TOL
    resumed = run_processes(fit_dlrm, 4, "column_wise", 8, resume_from=path, column_shard_dim=4, timeout=300)
    control = run_processes(fit_dlrm, 4, "column_wise", 8, resume_from=path, column_shard_dim=4,
                            reset_table_optimizer=True, timeout=300)[0]
    diffs = [max_abs_difference(losses, uninterrupted[EPOCH_STEPS:]) for losses in resumed]
    print(f"resumed 4 x column_wise vs uninterrupted 2 x table_wise: max |diff| per rank {diffs}")
    assert max(diffs) < TOL, diffs
    control_diff = max_abs_difference(control, uninterrupted[EPOCH_STEPS:])
    print(f"negative control (table optimizer state dropped): {control_diff:.2e}")
    assert control_diff > TOL
