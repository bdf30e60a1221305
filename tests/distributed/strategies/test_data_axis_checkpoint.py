"""A checkpoint saved under HSDP 2x2 x pp2 (8 processes) loads under pp2 x tp2 and under one process, exactly."""

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_regression_epochs

pytestmark = [pytest.mark.slow, pytest.mark.extended]

BATCHES, GLOBAL_BATCH, TOL = 4, 16, 1e-5
HSDP = {"pipeline_parallel_size": 2, "zero_stage": 2, "data_shard_size": 2}  # 8 ranks: (2 x 2) x pp2


def _fit(world_size, strategy, epochs, **kwargs):
    return fit_regression_epochs(world_size, strategy, epochs, batches=BATCHES, global_batch=GLOBAL_BATCH, **kwargs)[0]


def _save(rank, world_size, root):
    saver = ModelCheckpoint(dirpath=root, filename="hsdp", save_top_k=-1, save_on_train_epoch_end=True)
    return _fit(world_size, Hybrid(**HSDP), 1, callbacks=[saver])


def _load(rank, world_size, root, sizes):
    reference = _fit(1, "auto", 2) if world_size == 1 else None  # the uninterrupted single-process run
    return reference, _fit(world_size, Hybrid(**sizes), 2, ckpt_path=str(Path(root) / "hsdp.ckpt"), seed=1)


def test_a_checkpoint_saved_under_hsdp_with_pipeline_loads_under_other_layouts(tmp_path):
    saved = run_processes(_save, 8, str(tmp_path), timeout=900)
    [(reference, single)] = run_processes(_load, 1, str(tmp_path), {}, timeout=600)
    diffs = {"hsdp2x2xpp2 epoch 0": max_abs_difference(saved[0], reference[:BATCHES]),  # trains as one process
             "loaded by one process": max_abs_difference(single, reference[BATCHES:])}
    print("max |loss diff|:", diffs)
    assert all(d < TOL for d in diffs.values()), diffs
    pp2xtp2 = {"data_parallel_size": 1, "pipeline_parallel_size": 2, "tensor_parallel_size": 2}
    for rank, (_, losses) in enumerate(run_processes(_load, 4, str(tmp_path), pp2xtp2, timeout=600)):
        diff = max_abs_difference(losses, reference[BATCHES:])
        print(f"loaded by pp2 x tp2, rank {rank}: {diff:.2e}")
        assert diff < TOL, f"pp2 x tp2 rank {rank}: {diff:.2e}"
