"""A checkpoint written under expert parallelism resumes under another expert size with the uninterrupted losses.

Each rank holds E / ep experts as ``Shard(0)`` slices of the unsplit weights, so the DCP folder holds every
expert under its unsplit name: saved at the end of epoch 0 under data 2 x expert 2, epoch 1 runs under one
process (every expert on it) and under data 4 x expert 4 (one expert per rank) with the losses of one
process that never stopped.
"""

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_text_epochs
from tests.distributed.strategies.test_expert_parity import moe_gpt

pytestmark = pytest.mark.slow

BATCHES, BATCH = 4, 8  # batches per epoch, global batch


def _fit(world_size, strategy, epochs, callbacks=(), ckpt_path=None):
    return fit_text_epochs(moe_gpt, world_size, strategy, epochs, batches=BATCHES, global_batch=BATCH,
                           data_parallel=world_size, callbacks=callbacks, ckpt_path=ckpt_path)


def _uninterrupted(rank, world_size):
    return _fit(world_size, "auto", 2)


def _save(rank, world_size, root):
    saver = ModelCheckpoint(dirpath=root, filename="ep2", save_top_k=-1, save_on_train_epoch_end=True)
    return _fit(world_size, Hybrid(data_parallel_size=2, expert_parallel_size=2), 1, [saver])


def _resume(rank, world_size, root):
    strategy = Hybrid(data_parallel_size=world_size, expert_parallel_size=world_size)
    return _fit(world_size, strategy, 2, ckpt_path=str(Path(root) / "ep2.ckpt"))


def test_saved_under_two_expert_ranks_resumes_under_one_and_four(tmp_path):
    run_processes(_save, 2, str(tmp_path), timeout=600)
    reference = run_processes(_uninterrupted, 1)[0]
    assert len(reference) == 2 * BATCHES
    for world in (1, 4):
        for rank, losses in enumerate(run_processes(_resume, world, str(tmp_path), timeout=600)):
            diff = max_abs_difference(losses, reference[BATCHES:])
            assert len(losses) == BATCHES and diff < 1e-5, f"resumed under ep{world}, rank {rank}: {diff:.2e}"
