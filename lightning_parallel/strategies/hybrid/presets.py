"""Pipeline-only and tensor-only parallelism: the hybrid strategy with the other sizes at 1.

They exist for their names and defaults (``Trainer(strategy="pipeline_parallel")``); there is
no second implementation behind them, and every other argument is the hybrid strategy's.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.strategies.hybrid.strategy import HybridParallelStrategy


def _preset_sizes(size_name: str, options: Optional[ParallelOptions], option_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The preset's defaults for keyword options: its own size ``"auto"`` (all ranks), and with an explicit
    size the rest to data parallelism. An ``options`` object is taken as it is."""
    if options is None:
        option_kwargs.setdefault(size_name, "auto")
        option_kwargs.setdefault("data_parallel_size", 1 if option_kwargs[size_name] == "auto" else "auto")
    return option_kwargs


class PipelineParallelStrategy(HybridParallelStrategy):
    """Pipeline parallelism over ``torch.distributed.pipelining``.

    With ``pipeline_parallel_size="auto"`` (the default here) every rank is a pipeline stage; an
    explicit size smaller than the world leaves the rest to data parallelism.

    Args:
        options: see :class:`~lightning_parallel.parallel.options.ParallelOptions` (``microbatches``,
            ``schedule``, ``partition``, ``stages_per_rank``, ``zero_stage``, ...), taken as it is; or
            its fields as keywords, where this preset's size defaults apply.
        process_group_backend: see :class:`HybridParallelStrategy`.
        load_optimizer_state: see :class:`HybridParallelStrategy`.
        fault_tolerance: see :class:`HybridParallelStrategy`.
        **option_kwargs: fields of ``ParallelOptions`` by name, e.g. ``pipeline_parallel_size=2``.
    """

    strategy_name = "pipeline_parallel"

    def __init__(self, options: Optional[ParallelOptions] = None, *, process_group_backend: Optional[str] = None,
                 load_optimizer_state: bool = True, fault_tolerance: Any = None, **option_kwargs: Any) -> None:
        super().__init__(options, process_group_backend=process_group_backend,
                         load_optimizer_state=load_optimizer_state, fault_tolerance=fault_tolerance,
                         **_preset_sizes("pipeline_parallel_size", options, option_kwargs))


class TensorParallelStrategy(HybridParallelStrategy):
    """Tensor parallelism on DTensor, driven by the module's ``tensor_parallel_plan()``.

    With ``tensor_parallel_size="auto"`` (the default here) every rank shares each layer; an
    explicit size smaller than the world leaves the rest to data parallelism.

    Args:
        options: see :class:`~lightning_parallel.parallel.options.ParallelOptions` (``sequence_parallel``,
            ``loss_parallel``, ``plan``, ...), taken as it is; or its fields as keywords, where this
            preset's size defaults apply.
        process_group_backend: see :class:`HybridParallelStrategy`.
        load_optimizer_state: see :class:`HybridParallelStrategy`.
        fault_tolerance: see :class:`HybridParallelStrategy`.
        **option_kwargs: fields of ``ParallelOptions`` by name, e.g. ``tensor_parallel_size=2``.
    """

    strategy_name = "tensor_parallel"

    def __init__(self, options: Optional[ParallelOptions] = None, *, process_group_backend: Optional[str] = None,
                 load_optimizer_state: bool = True, fault_tolerance: Any = None, **option_kwargs: Any) -> None:
        super().__init__(options, process_group_backend=process_group_backend,
                         load_optimizer_state=load_optimizer_state, fault_tolerance=fault_tolerance,
                         **_preset_sizes("tensor_parallel_size", options, option_kwargs))


class ContextParallelStrategy(HybridParallelStrategy):
    """Context parallelism: every sequence split over the ranks (ring or all-to-all attention).

    With ``context_parallel_size="auto"`` (the default here) every rank holds a share of every sequence; an
    explicit size smaller than the world leaves the rest to data parallelism.

    Args:
        options: see :class:`~lightning_parallel.parallel.options.ParallelOptions` (``context_parallel_method``,
            ...), taken as it is; or its fields as keywords, where this preset's size defaults apply.
        process_group_backend: see :class:`HybridParallelStrategy`.
        load_optimizer_state: see :class:`HybridParallelStrategy`.
        fault_tolerance: see :class:`HybridParallelStrategy`.
        **option_kwargs: fields of ``ParallelOptions`` by name, e.g. ``context_parallel_size=2``.
    """

    strategy_name = "context_parallel"

    def __init__(self, options: Optional[ParallelOptions] = None, *, process_group_backend: Optional[str] = None,
                 load_optimizer_state: bool = True, fault_tolerance: Any = None, **option_kwargs: Any) -> None:
        if options is None:  # "auto" context takes explicit other sizes: data 1 unless given
            option_kwargs.setdefault("context_parallel_size", "auto")
            auto = option_kwargs["context_parallel_size"] == "auto"
            option_kwargs.setdefault("data_parallel_size", 1 if auto else "auto")
        super().__init__(options, process_group_backend=process_group_backend,
                         load_optimizer_state=load_optimizer_state, fault_tolerance=fault_tolerance, **option_kwargs)
