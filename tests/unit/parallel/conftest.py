"""A gloo process group of one process, for parallelising a module without spawning ranks."""

import pytest
import torch.distributed as dist

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.layout.meshes import RunMeshes


@pytest.fixture
def world_of_one(tmp_path):
    """``(layout, meshes)`` of a world of one (:class:`RunMeshes`); the process group is destroyed after the test."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    layout = ParallelLayout(1, 1, 1, 1)
    yield layout, RunMeshes.build(layout, "cpu")
    dist.destroy_process_group()
