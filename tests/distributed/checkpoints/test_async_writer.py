"""``async_save=True``: the sharded folder is written in the background, appears complete or not at all, and a run
resumed from it equals the uninterrupted one -- also when a process dies while a save is in flight.

The kill lands at three points of the save after step 4 (the second one): while the step copies the state to CPU
memory, while the background thread writes the shards, and on the coordinator after every shard is written but
before Lightning's metadata and the rename. Each time ``last.ckpt`` must still be step 2's complete folder, and the
resume from it must give the uninterrupted run's losses.
"""

import os
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.checkpoints.safe_loading import load_plain
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.processes import DistributedRunError
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

STEPS, EVERY, GLOBAL_BATCH = 6, 2, 8
LAYOUTS = {
    "pipeline 2": partial(Hybrid, pipeline_parallel_size=2, data_parallel_size=1),
    "data 2 (ZeRO 3)": partial(Hybrid, data_parallel_size=2, zero_stage=3),
}
EXTENDED = pytest.mark.extended  # the suite's time budget: one cell of each test in the default run


def _fit(root, strategy, async_save, ckpt_path=None, seed=0, only_last=False):
    history = LossHistory()
    pl.seed_everything(0)
    saver = ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0 if only_last else -1, every_n_train_steps=EVERY,
                            filename="step{step}", auto_insert_metric_name=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy(async_save=async_save, timeout=60), max_steps=STEPS,
        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[history, saver],
    )  # fmt: skip
    dp = trainer.strategy.resolve_layout(2).data_parallel
    data = FixedOrderData(regression_dataset(STEPS * GLOBAL_BATCH, 32), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(ResidualMLP(optimizer="adamw", seed=seed), datamodule=data, ckpt_path=ckpt_path)
    return history.losses


def _async_then_resume(rank, world_size, strategy, root):
    root = Path(root)
    written = _fit(root / "async", strategy, True)
    synchronous = _fit(root / "sync", strategy, False)
    resumed = _fit(root / "resumed", strategy, True, ckpt_path=str(root / "async" / "step4.ckpt"), seed=1)
    return {"async": written, "sync": synchronous, "resumed": resumed,
            "left": sorted(p.name for p in (root / "async").iterdir())}


@pytest.mark.parametrize("layout", ["pipeline 2", pytest.param("data 2 (ZeRO 3)", marks=EXTENDED)])
def test_async_checkpoints_resume_as_synchronous_ones_do(layout, tmp_path):
    results = run_processes(_async_then_resume, 2, LAYOUTS[layout], str(tmp_path), timeout=600)
    for result in results:
        assert max_abs_difference(result["async"], result["sync"]) == 0.0  # saving in the background changes nothing
        assert max_abs_difference(result["resumed"], result["async"][4:]) < 1e-6
    # every save committed before the run ended (the last one by teardown); no hidden partial folder left
    assert results[0]["left"] == ["last.ckpt", "step2.ckpt", "step4.ckpt", "step6.ckpt"]


def _die_during_second_save(point):
    """Patch this process so that it exits (as a killed process does) at ``point`` of its second save."""
    import lightning_parallel.checkpoints.dcp.async_writer as writer
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager

    calls = {"n": 0}

    def second(original):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(17)
            return original(*args, **kwargs)
        return wrapped

    if point == "staging":
        DefaultStager.stage = second(DefaultStager.stage)
    elif point == "writing shards":
        FileSystemWriter.write_data = second(FileSystemWriter.write_data)
    else:  # "before the commit": the coordinator's thread, after every shard and DCP's metadata are written
        writer.commit = second(writer.commit)


def _killed_run(rank, world_size, strategy, root, point):
    if point != "before the commit" or rank == 0:
        _die_during_second_save(point)
    _fit(Path(root), strategy, True, only_last=True)  # one save per checkpoint step: the second is step 4's


def _resume(rank, world_size, strategy, root, ckpt_path):
    return {"full": _fit(Path(root) / "full", strategy, True),
            "resumed": _fit(Path(root) / "resumed", strategy, True, ckpt_path=ckpt_path, seed=1)}


@pytest.mark.parametrize("point", ["writing shards", pytest.param("staging", marks=EXTENDED),
                                   pytest.param("before the commit", marks=EXTENDED)])
def test_a_process_killed_during_an_async_save_leaves_the_previous_checkpoint_to_resume(point, tmp_path):
    strategy = LAYOUTS["pipeline 2"]
    with pytest.raises(DistributedRunError):
        run_processes(_killed_run, 2, strategy, str(tmp_path / "killed"), point, timeout=300)
    last = tmp_path / "killed" / "last.ckpt"
    assert not (tmp_path / "killed" / "step4.ckpt").exists()
    assert load_plain(last / "meta.pt")["global_step"] == 2  # the complete folder from before the kill
    results = run_processes(_resume, 2, strategy, str(tmp_path), str(last), timeout=300)
    for result in results:
        assert max_abs_difference(result["resumed"], result["full"][2:]) < 1e-6


def test_async_save_needs_the_sharded_folder():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        Hybrid(async_save=True, save_distributed_checkpoint=False)
    assert torch.distributed.is_available()
