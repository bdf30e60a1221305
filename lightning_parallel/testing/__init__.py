"""Tools to test parallel layouts on CPU: a multi-process runner and loss recorders."""

from lightning_parallel.testing.parity import BatchHistory, LossHistory, max_abs_difference
from lightning_parallel.testing.processes import DistributedRunError, free_port, run_processes

__all__ = ["BatchHistory", "DistributedRunError", "LossHistory", "free_port", "max_abs_difference", "run_processes"]
