"""Training that survives a lost replica group: torchft's quorum, cross-group gradient averaging and live recovery
on the hybrid strategy (``HybridParallelStrategy(fault_tolerance=...)``, ``strategy.fault_tolerance`` in configs).

See docs/fault-tolerance.md. torchft is an optional dependency (``pip install 'lightning_parallel[ft]'``); nothing
here imports it until a run turns fault tolerance on.
"""

from lightning_parallel.fault_tolerance.lighthouse import check_reachable, start_lighthouse
from lightning_parallel.fault_tolerance.options import FaultTolerance
from lightning_parallel.fault_tolerance.replicas import ReplicaGroups

__all__ = ["FaultTolerance", "ReplicaGroups", "check_reachable", "start_lighthouse"]
