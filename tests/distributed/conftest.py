"""Fixtures shared by distributed tests in several folders."""

from pathlib import Path

import pytest

from lightning_parallel.testing import run_processes
from tests.distributed.saved_checkpoints import WORLD_SIZE, save_epoch_zero


@pytest.fixture(scope="session")
def hybrid_checkpoints(tmp_path_factory) -> Path:
    """The folder of suite checkpoints taken at the end of epoch 0 (see ``saved_checkpoints.py``); read-only."""
    root = tmp_path_factory.mktemp("hybrid_checkpoints")
    run_processes(save_epoch_zero, WORLD_SIZE, str(root), timeout=900)
    return root
