"""Save and resume with the same layout is exact, and checkpoints hold full, unsharded names and shapes."""

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

BATCHES_PER_EPOCH = 4
GLOBAL_BATCH = 16
LAYOUTS = {
    "pp2": (2, partial(Hybrid, data_parallel_size=1, pipeline_parallel_size=2)),
    "tp2": (2, partial(Hybrid, data_parallel_size=1, tensor_parallel_size=2)),
    "dp2xpp2-zero3": (4, partial(Hybrid, pipeline_parallel_size=2, zero_stage=3)),
    "pp2xtp2": (4, partial(Hybrid, pipeline_parallel_size=2, tensor_parallel_size=2)),
}


def _fit(world_size, strategy, history, epochs, callbacks, seed=0, ckpt_path=None):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy(), max_epochs=epochs,
        limit_train_batches=BATCHES_PER_EPOCH,
        limit_val_batches=0, logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[history, *callbacks],
    )
    dp = trainer.strategy.resolve_layout(world_size).data_parallel
    data = FixedOrderData(regression_dataset(BATCHES_PER_EPOCH * GLOBAL_BATCH, 32), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(ResidualMLP(optimizer="adamw", seed=seed), datamodule=data, ckpt_path=ckpt_path)
    return trainer


def _resume_run(rank, world_size, strategy, root):
    """Two epochs straight vs. one epoch, a checkpoint at its end, and a resume into a differently seeded model.

    Note:
        ModelCheckpoint saves at the end of epoch 0. Mid-epoch and the other epoch-end
        checkpoints (step-based, validation end, after fit) are proven exact, data order
        included, in tests/distributed/callbacks/test_exact_resume.py.
    """
    full = LossHistory()
    _fit(world_size, strategy, full, 2, [])
    first = LossHistory()
    saver = ModelCheckpoint(dirpath=root, filename="epoch0", save_top_k=-1, save_on_train_epoch_end=True)
    _fit(world_size, strategy, first, 1, [saver])
    resumed = LossHistory()
    _fit(world_size, strategy, resumed, 2, [], seed=1, ckpt_path=str(Path(root) / "epoch0.ckpt"))
    return {"full": full.losses, "first": first.losses, "resumed": resumed.losses}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_with_the_same_layout_is_exact(layout, tmp_path):
    world, strategy = LAYOUTS[layout]
    for rank, result in enumerate(run_processes(_resume_run, world, strategy, str(tmp_path), timeout=900)):
        full, resumed = result["full"], result["resumed"]
        assert len(resumed) == BATCHES_PER_EPOCH
        assert max_abs_difference(result["first"], full[:BATCHES_PER_EPOCH]) < 1e-6
        diff = max_abs_difference(resumed, full[BATCHES_PER_EPOCH:])
        assert diff < 1e-6, f"{layout} rank {rank}: resumed losses differ by {diff:.2e}"
    # The sharded checkpoint stores every tensor under its unsplit name and full shape, so the
    # checkpoint issue can load it under another layout.
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(tmp_path / "epoch0.ckpt")).read_metadata().state_dict_metadata
    expected = {f"state_dict.{k}": tuple(v.shape) for k, v in ResidualMLP().state_dict().items()}
    stored = {k: tuple(v.size) for k, v in metadata.items() if k.startswith("state_dict.")}
    assert stored == expected
    assert any(k.startswith("optimizer_0.state.") for k in metadata)
