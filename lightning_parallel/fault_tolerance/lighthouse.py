"""The lighthouse: torchft's quorum server, started here for a single-node run and checked before any manager.

On a cluster it runs once, beside the jobs (``torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000``), and
every replica group gets its address as ``$TORCHFT_LIGHTHOUSE`` (docs/fault-tolerance.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

INSTALL_HINT = "pip install 'lightning_parallel[ft]' (torchft)"


def require_torchft() -> Any:
    """The ``torchft`` module, or an ``ImportError`` naming the extra to install."""
    try:
        import torchft
    except ImportError as error:
        raise ImportError(f"strategy.fault_tolerance needs torchft: {INSTALL_HINT}.") from error
    return torchft


def start_lighthouse(min_replicas: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 3000,
                     bind: str = "[::]:0") -> Any:
    """Start a lighthouse in this process; returns the server (``.address()``, ``.shutdown()``).

    Args:
        min_replicas: replica groups a quorum needs.
        join_timeout_ms: how long a quorum waits for heartbeating groups that have not asked to join yet; short
            on one node, where every group is seconds away.
        heartbeat_timeout_ms: how long a silent replica group counts as alive; a lost group leaves the quorum
            this long after its last heartbeat.
        bind: address to listen on (``[::]:0``: any free port).
    """
    require_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def check_reachable(address: str, connect_timeout: float) -> None:
    """Connect to the lighthouse once, so an unreachable one is an error now, not a hang at the first step.

    Args:
        address: ``http://host:port``.
        connect_timeout: seconds to try.

    Raises:
        RuntimeError: not reachable within ``connect_timeout``; names the address and the fix.
    """
    require_torchft()
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=connect_timeout))
    except Exception as error:  # torchft raises RuntimeError with the transport's reason
        raise RuntimeError(
            f"fault_tolerance: the lighthouse at {address} is not reachable within {connect_timeout:g} s ({error}). "
            "Start it (`torchft_lighthouse --min_replicas 1`) or fix fault_tolerance.lighthouse / $TORCHFT_LIGHTHOUSE."
        ) from error
