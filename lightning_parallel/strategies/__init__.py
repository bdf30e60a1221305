"""Lightning strategies of the suite, registered by name on import.

``import lightning_parallel`` makes ``Trainer(strategy="pipeline_parallel")`` (and the other
names) work: Lightning has no entry-point discovery for strategies.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.strategies.hybrid.strategy import HybridParallelStrategy
from lightning_parallel.strategies.hybrid.presets import (
    ContextParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

STRATEGIES = (DeepSpeedDataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy,
              ContextParallelStrategy, TorchRecStrategy)


def register_all(registry=StrategyRegistry) -> None:
    """Register every strategy of the suite in Lightning's ``StrategyRegistry`` (idempotent)."""
    for strategy in STRATEGIES:
        strategy.register_strategies(registry)


register_all()

__all__ = [
    "ContextParallelStrategy",
    "DeepSpeedDataParallelStrategy",
    "HybridParallelStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "TorchRecStrategy",
    "register_all",
]
