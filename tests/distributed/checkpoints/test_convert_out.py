"""Suite checkpoints (dp2 x tp2, pp2 x tp2) -> ``lp-convert --to lightning`` -> Lightning's own ``auto`` and ``ddp``
strategies resume them with the losses and optimizer step counts of the uninterrupted single-process run."""

import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.checkpoints.convert import main as lp_convert
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

BATCHES = 4  # per epoch; checkpoints are taken at the end of epoch 0
GLOBAL_BATCH = 16
SAVE_LAYOUTS = {"dp2xtp2": {"tensor_parallel_size": 2}, "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}}


def _fit(world_size, strategy, epochs, callbacks=(), ckpt_path=None, seed=0):
    pl.seed_everything(0)
    history = LossHistory()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, limit_train_batches=BATCHES,
                         limit_val_batches=0, logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[history, *callbacks])
    dp = world_size if strategy == "ddp" else 1 if isinstance(strategy, str) else strategy.resolve_layout(world_size).data_parallel
    data = FixedOrderData(regression_dataset(BATCHES * GLOBAL_BATCH, 32), batch_size=GLOBAL_BATCH // dp)
    trainer.fit(ResidualMLP(optimizer="adamw", seed=seed), datamodule=data, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    steps = sorted({int(s["step"]) for s in optimizer.state.values()})
    return history.losses, steps


def _save_all(rank, world_size, root):
    for name, sizes in SAVE_LAYOUTS.items():
        saver = ModelCheckpoint(dirpath=root, filename=name, save_top_k=-1, save_on_train_epoch_end=True)
        _fit(world_size, Hybrid(**sizes), 1, [saver])


def _resume_all(rank, world_size, root, strategy, reference):
    out = {name: _fit(world_size, strategy, 2, ckpt_path=str(Path(root) / f"{name}.lightning.ckpt"), seed=1)
           for name in SAVE_LAYOUTS}
    if reference:
        out["reference"] = _fit(world_size, strategy, 2)
    return out


def test_suite_checkpoints_converted_to_lightning_resume_under_auto_and_ddp_exactly(tmp_path, capsys):
    run_processes(_save_all, 4, str(tmp_path), timeout=900)
    for name in SAVE_LAYOUTS:
        start = time.perf_counter()
        assert lp_convert([str(tmp_path / f"{name}.ckpt"), str(tmp_path / f"{name}.lightning.ckpt"), "--to", "lightning"]) == 0
        print(f"{name}: converted in {time.perf_counter() - start:.2f}s")
    (single,) = run_processes(_resume_all, 1, str(tmp_path), "auto", True, timeout=900)
    reference_losses, reference_steps = single.pop("reference")
    assert reference_steps == [2 * BATCHES]
    ddp = run_processes(_resume_all, 2, str(tmp_path), "ddp", False, timeout=900)
    for target, results in (("auto", [single]), ("ddp", ddp)):
        for rank, result in enumerate(results):
            for source, (losses, steps) in result.items():
                assert len(losses) == BATCHES and steps == reference_steps
                diff = max_abs_difference(losses, reference_losses[BATCHES:])
                print(f"{source} -> lightning -> {target} rank {rank}: max |loss diff| {diff:.2e}, steps {steps}")
                assert diff < 1e-5, f"{source} -> {target} rank {rank}: {diff:.2e}"
