"""One rank of a simulated world: torch's fake process group, in which every collective returns at once.

One CPU process plays each rank it is asked to, one after another: the suite's own meshes
(:class:`~lightning_parallel.layout.meshes.RunMeshes`) and :func:`~lightning_parallel.parallel.compose.parallelize`
run there unchanged, on a model built on ``meta``, so nothing the size of the model is ever allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` inside; the fake world is left again on the way out.

    Args:
        rank: the rank to play.
        world_size: the world's size.

    Raises:
        ValueError: a process group exists already (a simulation cannot share a process with a real run).
    """
    import torch.distributed as dist

    from lightning_parallel import _compat

    if dist.is_initialized():
        raise ValueError("a process group exists in this process already: simulate in a process of its own "
                         "(lp-simulate, or a Python process that has not called init_process_group).")
    _compat.init_fake_process_group(rank, world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _compat.clear_dtensor_caches()  # cached placements hold this world's meshes and group names
