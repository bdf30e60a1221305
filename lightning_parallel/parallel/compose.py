"""The one place that knows the order in which the parallelisms are applied.

:func:`parallelize` turns a whole module into this rank's share of a data x pipeline x
tensor layout, in torchtitan's order:

1. **pipeline split** -- cut ``pipeline_layers()`` into stages and keep only this rank's
   layers (the others become parameter-free placeholders), so every later step touches
   only what this rank holds and parameter names never change;
2. **tensor parallelism** -- ``parallelize_module`` on the submodules this rank holds; it
   must precede FSDP2, which shards the DTensor parameters TP created along one more axis;
3. *(reserved)* **activation checkpointing** -- wraps the (tensor-sharded) layers, before
   FSDP2 so that recomputation sees the sharded layer and FSDP2's unit boundaries stay
   the layers;
4. *(reserved)* **mixed-precision policy** -- FSDP2's ``MixedPrecisionPolicy`` is an
   argument of step 5; a policy object will be threaded through here;
5. **data axis** -- FSDP2 ``fully_shard`` per layer and per root for ``zero_stage`` 2/3.
   Replicated data parallelism (``zero_stage=0``) changes no module: its gradient
   all-reduce runs once per optimizer step, outside the module.

Nothing here imports Lightning: the strategy calls :func:`check_module` before any process
group exists and :func:`parallelize` once the mesh is built; both are testable without a
Trainer (a world of 1, or the distributed harness).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_parallel.layout import DATA_PARALLEL, TENSOR_PARALLEL, ParallelLayout
from lightning_parallel.parallel.data import shard_data_axis
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.partition import partition_layers
from lightning_parallel.parallel.pipeline import (
    PipelineSplit,
    RemovedLayer,
    split_module,
    stage_ids_for_rank,
    validate_schedule,
)
from lightning_parallel.parallel.tensor import apply_tensor_parallel, resolve_plan, validate_tensor_parallel
from lightning_parallel.protocol import require_pipeline_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class Parallelized:
    """What :func:`parallelize` did to a module, and what a step executor needs from it.

    Attributes:
        layout: the layout it was parallelised for.
        options: the options it was parallelised with.
        plan: the resolved tensor-parallel plan of the whole model (empty without TP).
        split: the pipeline split (None without pipelining).
        stages: this rank's stage modules (empty without pipelining).
        stage_ids: their stage indices.
        last_stage_rank: global rank holding the last stage in this rank's pipeline (None without).
    """

    layout: ParallelLayout
    options: ParallelOptions
    plan: dict[str, ParallelStyle]
    split: Optional[PipelineSplit] = None
    stages: tuple[nn.Module, ...] = ()
    stage_ids: tuple[int, ...] = ()
    last_stage_rank: Optional[int] = None

    @property
    def pipelined(self) -> bool:
        return self.split is not None

    @property
    def num_stages(self) -> int:
        return self.split.num_stages if self.split is not None else 1


def check_module(module: nn.Module, layout: ParallelLayout, options: ParallelOptions) -> dict[str, ParallelStyle]:
    """Everything about ``module`` that can be checked before a process group exists.

    Args:
        module: the whole model (any device, ``meta`` included).
        layout: the resolved layout.
        options: the run's options.

    Returns:
        The resolved tensor-parallel plan (empty without tensor parallelism).

    Raises:
        ValueError: a module that cannot be pipelined, too few layers for the stages, a
            schedule the layout cannot run, or a plan the tensor size does not divide.
    """
    if layout.pipeline_parallel_enabled:
        require_pipeline_module(module)
        validate_schedule(options.schedule, layout.pipeline_parallel, options.stages_per_rank, options.microbatches)
        num_layers, num_stages = len(module.pipeline_layers()), options.num_stages(layout.pipeline_parallel)
        if num_layers < num_stages:
            fits = num_layers // layout.pipeline_parallel
            remedy = (f"stages_per_rank <= {fits}" if fits >= 1 else f"pipeline_parallel_size <= {num_layers}")
            raise ValueError(
                f"{type(module).__name__} has {num_layers} pipeline layers, fewer than the {num_stages} stages of "
                f"pipeline_parallel_size={layout.pipeline_parallel} x stages_per_rank={options.stages_per_rank}: "
                f"every stage needs a layer. Fix: {remedy}, or a model with more layers."
            )
    if not layout.tensor_parallel_enabled:
        return {}
    plan = resolve_plan(
        module, options.plan, sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel
    )
    validate_tensor_parallel(module, plan, layout.tensor_parallel)
    return plan


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` was already split or sharded (placeholders, DTensor parameters or FSDP2 units)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, (RemovedLayer, FSDPModule)) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def last_stage_rank(layout: ParallelLayout, options: ParallelOptions, rank: int) -> int:
    """Global rank that holds the last pipeline stage in ``rank``'s pipeline (same data and tensor coordinates)."""
    coords = layout.coordinates(rank)
    num_stages = options.num_stages(layout.pipeline_parallel)
    holder = next(
        r
        for r in range(layout.pipeline_parallel)
        if num_stages - 1 in stage_ids_for_rank(options.schedule, r, layout.pipeline_parallel, options.stages_per_rank)
    )
    return layout.rank_at(coords.data, holder, coords.tensor)


def split_pipeline(
    module: nn.Module,
    layout: ParallelLayout,
    options: ParallelOptions,
    rank: int,
    layer_times: Optional[Sequence[float]] = None,
) -> tuple[PipelineSplit, list[nn.Module], list[int]]:
    """Cut ``module`` into stages and keep this rank's (step 1 of :func:`parallelize`)."""
    layers = module.pipeline_layers()
    num_stages = options.num_stages(layout.pipeline_parallel)
    bounds = partition_layers(layers, num_stages, options.partition, layer_times)
    pipeline_rank = layout.coordinates(rank).pipeline
    stage_ids = stage_ids_for_rank(options.schedule, pipeline_rank, layout.pipeline_parallel, options.stages_per_rank)
    split, stages = split_module(module, layers, bounds, stage_ids)
    return split, stages, stage_ids


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    rank: int,
    layer_times: Optional[Sequence[float]] = None,
    on_split: Optional[Callable[[PipelineSplit], Any]] = None,
) -> Parallelized:
    """Split, shard and wrap ``module`` in place for this rank of ``layout`` (see the module docstring for the order).

    Args:
        module: the whole model, materialised on its device in its training precision
            (converting or moving it afterwards would drop TP's gradient-placement hooks).
        layout: the resolved layout.
        mesh: the 3-D mesh ``layout.build_mesh`` made (axes data, pipeline, tensor).
        options: the run's options.
        rank: this process's global rank.
        layer_times: per-layer seconds for ``partition="time"`` (the same on every rank).
        on_split: called with the pipeline split once it is known (the strategy prints it).

    Returns:
        A :class:`Parallelized` describing the result.

    Raises:
        ValueError: ``module`` was parallelised before (build a fresh one and load a
            checkpoint instead), or any check of :func:`check_module`.
    """
    if is_parallelized(module):
        raise ValueError(
            f"{type(module).__name__} was already split or sharded by an earlier run and cannot be parallelised again: "
            "build a fresh module and load the checkpoint into it (ckpt_path=...)."
        )
    plan = check_module(module, layout, options)
    split, stages, stage_ids, last = None, [], [], None
    if layout.pipeline_parallel_enabled:
        split, stages, stage_ids = split_pipeline(module, layout, options, rank, layer_times)
        last = last_stage_rank(layout, options, rank)
        if on_split is not None:
            on_split(split)
    if layout.tensor_parallel_enabled:
        present = dict(module.named_modules())
        local_plan = {n: s for n, s in plan.items() if n in present and not isinstance(present[n], RemovedLayer)}
        apply_tensor_parallel(module, mesh[TENSOR_PARALLEL], local_plan)
    # (3) activation checkpointing and (4) the mixed-precision policy slot in here.
    if options.zero_stage:
        layers = module.pipeline_layers() if callable(getattr(module, "pipeline_layers", None)) else []
        shard_data_axis(layers, stages or [module], mesh[DATA_PARALLEL], options.zero_stage)
    return Parallelized(layout, options, plan, split, tuple(stages), tuple(stage_ids), last)
