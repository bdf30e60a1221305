"""lightning_parallel: pipeline, tensor, context, hybrid and DeepSpeed ZeRO parallelism for PyTorch Lightning.

Importing the package registers its strategies with Lightning, so
``Trainer(strategy="pipeline_parallel")`` works after ``import lightning_parallel``.
"""

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.strategies import (
    ContextParallelStrategy,
    DeepSpeedDataParallelStrategy,
    HybridParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    TorchRecStrategy,
)

__all__ = [
    "ContextParallelStrategy",
    "DeepSpeedDataParallelStrategy",
    "HybridParallelStrategy",
    "ParallelLayout",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "TorchRecStrategy",
]
__version__ = "0.1.0"
