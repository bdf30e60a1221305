"""Suite checkpoints saved once per test session, for the tests that load, convert or export them.

Each layout fits the residual MLP for one epoch (``BATCHES`` AdamW steps on global batches of
``GLOBAL_BATCH``) on 4 processes and checkpoints at the epoch's end; the ``hybrid_checkpoints``
fixture (tests/distributed/conftest.py) makes them in one launch and hands out the folder, which
tests read but never change.
"""

from functools import partial

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing.fit import fit_regression_epochs

BATCHES = 4
GLOBAL_BATCH = 16
WORLD_SIZE = 4
# checkpoint name (``<name>.ckpt`` in the folder) -> HybridParallelStrategy arguments
SAVE_LAYOUTS = {
    "dp2xtp2": {"tensor_parallel_size": 2},
    "pp2xtp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "dp2xpp2": {"pipeline_parallel_size": 2},
}

fit = partial(fit_regression_epochs, batches=BATCHES, global_batch=GLOBAL_BATCH)


def save_epoch_zero(rank: int, world_size: int, root: str) -> None:
    """Rank function: every layout of ``SAVE_LAYOUTS`` trains epoch 0 and writes ``root/<name>.ckpt``."""
    for name, sizes in SAVE_LAYOUTS.items():
        saver = ModelCheckpoint(dirpath=root, filename=name, save_top_k=-1, save_on_train_epoch_end=True)
        fit(world_size, HybridParallelStrategy(**sizes), 1, callbacks=[saver])
