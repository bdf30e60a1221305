"""Pipeline-only and tensor-only parallelism: the hybrid strategy with the other sizes at 1.

They exist for their names and signatures (``Trainer(strategy="pipeline_parallel")``);
there is no second implementation behind them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

from lightning_parallel.layout import Size
from lightning_parallel.strategies.hybrid import HybridParallelStrategy


class PipelineParallelStrategy(HybridParallelStrategy):
    """Pipeline parallelism over ``torch.distributed.pipelining``.

    With ``pipeline_parallel_size="auto"`` every rank is a pipeline stage; an explicit size
    smaller than the world leaves the rest to data parallelism.

    Args:
        pipeline_parallel_size: pipeline ranks, or ``"auto"`` for all of them.
        microbatches: micro-batches per batch.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``,
            ``interleaved_zero_bubble``, ``zbv``, ``dualpipev``.
        partition: ``uniform``, ``parameters``, ``time`` or a list of cut points.
        stages_per_rank: stages per rank (2+ for interleaved and zero-bubble schedules).
        **kwargs: further :class:`HybridParallelStrategy` arguments (``zero_stage``, ``timeout``, ...).
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pipeline_parallel_size: Size = "auto",
        microbatches: int = 4,
        schedule: str = "1f1b",
        partition: Union[str, list[int]] = "parameters",
        stages_per_rank: int = 1,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("data_parallel_size", 1 if pipeline_parallel_size == "auto" else "auto")
        super().__init__(
            pipeline_parallel_size=pipeline_parallel_size,
            microbatches=microbatches,
            schedule=schedule,
            partition=partition,
            stages_per_rank=stages_per_rank,
            timeout=timeout,
            **kwargs,
        )


class TensorParallelStrategy(HybridParallelStrategy):
    """Tensor parallelism on DTensor, driven by the module's ``tensor_parallel_plan()``.

    Args:
        tensor_parallel_size: ranks sharing each layer, or ``"auto"`` for all of them.
        sequence_parallel: shard norm/dropout activations along the sequence.
        loss_parallel: vocab-parallel cross-entropy on a vocab-sharded LM head.
        plan: plan entries that override or extend the module's (glob -> style; None removes).
        **kwargs: further :class:`HybridParallelStrategy` arguments.
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel_size: Size = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        plan: Optional[dict] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("data_parallel_size", 1 if tensor_parallel_size == "auto" else "auto")
        super().__init__(
            tensor_parallel_size=tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            plan=plan,
            timeout=timeout,
            **kwargs,
        )
