"""The TorchRec strategy's room: :mod:`.strategy` (Lightning's lifecycle over ``DistributedModelParallel``),
:mod:`.sharding_plan` (TorchRec's planner on the run's topology, the plan's table), :mod:`.replicated` (replicated
tables' gradients and optimizer), :mod:`.checkpoint` (sharded tables in and out).
"""

from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

__all__ = ["TorchRecStrategy"]
