"""Step 1 of :func:`~lightning_parallel.parallel.compose.parallelize`: check a model's pipeline plan against the
layout, cut it into stages and keep this rank's, with its tied copies and the rank that holds the last stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from torch import nn

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.parallel.data import uses_data_axis
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.chain_check import check_chain, on_meta
from lightning_parallel.parallel.pipeline.partition import partition_layers, stage_of_layer
from lightning_parallel.parallel.pipeline.plan import PipelinePlan
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, stage_ids_for_rank, validate_schedule
from lightning_parallel.parallel.pipeline.stages import PipelineSplit, layer_names, shared_parameters, split_module

if TYPE_CHECKING:
    from lightning_parallel.parallel.adapter import ModelAdapter


def check_pipeline(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: ModelAdapter
) -> PipelinePlan:
    """The pipeline half of :func:`check_module`; returns the adapter's pipeline plan.

    ``adapter`` is the model's adapter, resolved once by the caller.
    """
    plan = adapter.pipeline_plan()
    validate_schedule(options.schedule, layout.pipeline_parallel, options.stages_per_rank, options.microbatches)
    activation_checkpoint.check_schedule(options.activation_checkpointing, options.schedule)
    num_layers, num_stages = len(plan.layers), options.num_stages(layout.pipeline_parallel)
    if num_layers < num_stages:
        fits = num_layers // layout.pipeline_parallel
        remedy = (f"stages_per_rank <= {fits}" if fits >= 1 else f"pipeline_parallel_size <= {num_layers}")
        raise ValueError(
            f"{type(module).__name__} has {num_layers} pipeline layers, fewer than the {num_stages} stages of "
            f"pipeline_parallel_size={layout.pipeline_parallel} x stages_per_rank={options.stages_per_rank}: "
            f"every stage needs a layer. Fix: {remedy}, or a model with more layers."
        )
    _check_pipeline_layers(module, plan, layout, options)
    if plan.sample is not None and not on_meta(module):
        check_chain(module, list(zip(plan.names, plan.layers)), plan.make_stage, plan.sample, plan.source)
    return plan


def last_stage_rank(layout: ParallelLayout, options: ParallelOptions, rank: int) -> int:
    """Global rank that holds the last pipeline stage in ``rank``'s pipeline (same data and tensor coordinates)."""
    coords = layout.coordinates(rank)
    num_stages = options.num_stages(layout.pipeline_parallel)
    holder = next(
        r
        for r in range(layout.pipeline_parallel)
        if num_stages - 1 in stage_ids_for_rank(options.schedule, r, layout.pipeline_parallel, options.stages_per_rank)
    )
    return layout.rank_at(coords.data, holder, coords.tensor, layout.context_rank(rank))


def _check_pipeline_layers(module: nn.Module, plan: PipelinePlan, layout: ParallelLayout,
                           options: ParallelOptions) -> None:
    if options.partition == "time" and not plan.timeable:
        raise ValueError(
            f"partition='time' times each layer on one tensor, but {plan.source}'s decoder layers also need masks and "
            "rotary positions: use partition='parameters', 'uniform' or explicit cut points."
        )
    layer_names(module, plan.layers)  # every parameter in some layer, layers not nested
    shared = shared_parameters(plan.names, plan.layers)
    if shared and uses_data_axis(layout, options.zero_stage) and SCHEDULES[options.schedule][2] == "v":
        tied = ", ".join(holders[0][1] for holders in shared)
        raise ValueError(
            f"{type(module).__name__} ties parameters across pipeline layers ({tied}); schedule={options.schedule!r} "
            "puts the first and the last stage on one rank, two stage modules holding one tied parameter, which "
            f"FSDP2 (the data axis, zero_stage={options.zero_stage}) cannot wrap twice. Fix: a loop schedule "
            "('1f1b', 'interleaved_1f1b'), data_parallel_size=1, or untie them."
        )


def split_pipeline(
    module: nn.Module,
    layout: ParallelLayout,
    options: ParallelOptions,
    rank: int,
    layer_times: Optional[Sequence[float]],
    plan: PipelinePlan,
) -> tuple[PipelineSplit, list[nn.Module], list[int]]:
    """Cut ``module`` into stages and keep this rank's (step 1 of :func:`parallelize`).

    ``layer_times`` are the measured seconds per layer (``partition="time"``, else None) and ``plan`` is the
    adapter's pipeline plan (:func:`check_pipeline`'s answer).
    """
    num_stages = options.num_stages(layout.pipeline_parallel)
    bounds = partition_layers(plan.layers, num_stages, options.partition, layer_times)
    pipeline_rank = layout.coordinates(rank).pipeline
    stage_ids = stage_ids_for_rank(options.schedule, pipeline_rank, layout.pipeline_parallel, options.stages_per_rank)
    split, stages = split_module(module, plan.layers, bounds, stage_ids, plan.make_stage)
    return split, stages, stage_ids


def tied_copies(split: PipelineSplit, layout: ParallelLayout, options: ParallelOptions, rank: int) -> list:
    """This rank's parameters tied to copies on other pipeline ranks (embedding and LM head)."""
    coords = layout.coordinates(rank)
    rank_of_stage = [0] * split.num_stages
    for pipeline_rank in range(layout.pipeline_parallel):
        for stage in stage_ids_for_rank(options.schedule, pipeline_rank, layout.pipeline_parallel,
                                        options.stages_per_rank):
            rank_of_stage[stage] = layout.rank_at(coords.data, pipeline_rank, coords.tensor, layout.context_rank(rank))
    return pipeline_tied.local_tied_copies(split.shared, stage_of_layer(list(split.bounds)), rank_of_stage, rank)


def tie_copies(module: nn.Module, split: PipelineSplit, stages: list, layout: ParallelLayout,
               options: ParallelOptions, rank: int) -> list:
    """Keep this rank's tied copies equal to their peers' (a broadcast, unless the model is still on ``meta``:
    its copies are then initialised from one name, :mod:`lightning_parallel.parallel.materialize`)."""
    tied = tied_copies(split, layout, options, rank)
    if not on_meta(module):
        pipeline_tied.broadcast_tied(module, tied)  # the copies start equal whatever each rank initialised
    stages[0].tied = tuple(tied)  # the runner finds them there and keeps their gradients summed
    return tied
