"""Pipeline-only and tensor-only parallelism: the hybrid strategy with the other sizes at 1.

They exist for their names and defaults (``Trainer(strategy="pipeline_parallel")``); there is
no second implementation behind them, and every other argument is the hybrid strategy's.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout import Size
from lightning_parallel.strategies.hybrid import HybridParallelStrategy


class PipelineParallelStrategy(HybridParallelStrategy):
    """Pipeline parallelism over ``torch.distributed.pipelining``.

    With ``pipeline_parallel_size="auto"`` every rank is a pipeline stage; an explicit size
    smaller than the world leaves the rest to data parallelism.

    Args:
        pipeline_parallel_size: pipeline ranks, or ``"auto"`` for all of them.
        **kwargs: :class:`HybridParallelStrategy` arguments (``microbatches``, ``schedule``,
            ``partition``, ``stages_per_rank``, ``zero_stage``, ``timeout``, ...).
    """

    strategy_name = "pipeline_parallel"

    def __init__(self, pipeline_parallel_size: Size = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("data_parallel_size", 1 if pipeline_parallel_size == "auto" else "auto")
        super().__init__(pipeline_parallel_size=pipeline_parallel_size, **kwargs)


class TensorParallelStrategy(HybridParallelStrategy):
    """Tensor parallelism on DTensor, driven by the module's ``tensor_parallel_plan()``.

    Args:
        tensor_parallel_size: ranks sharing each layer, or ``"auto"`` for all of them.
        **kwargs: :class:`HybridParallelStrategy` arguments (``sequence_parallel``,
            ``loss_parallel``, ``plan``, ``timeout``, ...).
    """

    strategy_name = "tensor_parallel"

    def __init__(self, tensor_parallel_size: Size = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("data_parallel_size", 1 if tensor_parallel_size == "auto" else "auto")
        super().__init__(tensor_parallel_size=tensor_parallel_size, **kwargs)
