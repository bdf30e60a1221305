"""torch.distributed's process-group defaults that the suite has to reach (see :mod:`lightning_parallel._compat`).

Each touch point says why it is private; ``tests/unit/test_compat.py`` has a canary for each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def default_group_timeout(timeout: Any) -> Iterator[None]:
    """Process groups created inside (a DeviceMesh's, which take no timeout) time out after ``timeout``.

    Why private: ``init_device_mesh`` and ``DeviceMesh._unflatten`` create their groups with ``new_group(timeout=None)``,
    which reads ``distributed_c10d.default_pg_timeout`` (30 min; ``default_pg_nccl_timeout`` for NCCL) when it runs: a
    strategy's ``timeout`` reached the world group only, and a rank hung in a 4-rank run held the others for 30 minutes.

    Args:
        timeout: a ``timedelta``.
    """
    import torch.distributed.distributed_c10d as c10d

    names = [name for name in ("default_pg_timeout", "default_pg_nccl_timeout") if getattr(c10d, name, None) is not None]
    saved = {name: getattr(c10d, name) for name in names}
    for name in names:
        setattr(c10d, name, timeout)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(c10d, name, value)
