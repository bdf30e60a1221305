"""A checkpoint written under context parallelism resumes under another context size with the uninterrupted losses.

Context ranks hold the same parameters (only the sequence is split), so the saved state does not depend on
the context size: saved at the end of epoch 0 under cp 2, epoch 1 under cp 1 and under cp 4 gives the
losses of one process that never stopped.
"""

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_text_epochs, tiny_gpt

pytestmark = pytest.mark.slow

BATCHES, BATCH = 4, 8  # batches per epoch, global batch (one data replica: every rank sees all of it)


def _fit(world_size, strategy, epochs, callbacks=(), ckpt_path=None):
    return fit_text_epochs(tiny_gpt, world_size, strategy, epochs, batches=BATCHES, global_batch=BATCH,
                           data_parallel=1, callbacks=callbacks, ckpt_path=ckpt_path)


def _uninterrupted(rank, world_size):
    return _fit(world_size, "auto", 2)


def _save(rank, world_size, root):
    saver = ModelCheckpoint(dirpath=root, filename="cp2", save_top_k=-1, save_on_train_epoch_end=True)
    return _fit(world_size, Hybrid(context_parallel_size=2), 1, [saver])


def _resume(rank, world_size, root, context):
    strategy = Hybrid(context_parallel_size=context)  # cp 1 on one process: the suite reads its folder
    return _fit(world_size, strategy, 2, ckpt_path=str(Path(root) / "cp2.ckpt"))


def test_saved_under_two_context_ranks_resumes_under_one_and_four(tmp_path):
    run_processes(_save, 2, str(tmp_path), timeout=600)
    reference = run_processes(_uninterrupted, 1)[0]  # one process, two epochs, never stopped
    assert len(reference) == 2 * BATCHES
    for context in (1, 4):
        for rank, losses in enumerate(run_processes(_resume, context, str(tmp_path), context, timeout=600)):
            diff = max_abs_difference(losses, reference[BATCHES:])
            assert len(losses) == BATCHES and diff < 1e-5, f"resumed under cp{context}, rank {rank}: {diff:.2e}"
