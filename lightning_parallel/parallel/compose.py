"""The one place that knows the order in which the parallelisms are applied.

:func:`parallelize` turns a whole module into this rank's share of a data x pipeline x
tensor layout, in torchtitan's order:

1. **pipeline split** -- cut ``pipeline_layers()`` into stages and keep only this rank's
   layers (the others become parameter-free placeholders), so every later step touches
   only what this rank holds and parameter names never change;
2. **tensor parallelism** -- ``parallelize_module`` on the submodules this rank holds; it
   must precede FSDP2, which shards the DTensor parameters TP created along one more axis;
3. **activation checkpointing** (``activation_checkpointing``, :mod:`.activation_checkpoint`)
   -- makes this rank's layers (or the submodules a glob list names) recompute their
   forward in backward: after TP, so recomputation runs the sharded layer and its
   collectives; before FSDP2, so FSDP2's units stay the layers and gather their
   parameters around the recomputation as around the forward;
4. **mixed-precision policy** (:mod:`.precision`) -- FSDP2's ``MixedPrecisionPolicy``
   from the Trainer's precision and ``param_dtype``/``reduce_dtype``, handed to step 5:
   bf16 all-gathered parameters under ``bf16-mixed`` and fp32 gradient reduce-scatter, but
   fp32 parameters with tensor parallelism, whose tensor-axis gradient all-reduce FSDP2
   would otherwise run in bf16 (pytorch#190626);
5. **data axis** -- FSDP2 ``fully_shard`` per layer and per root (:mod:`.data`): sharded
   for ``zero_stage`` 2/3 (HSDP on a ``(data_replicate, data_shard)`` mesh), replicated for
   ``zero_stage=0`` with data parallelism (shard groups of one rank), so gradients are
   reduced during backward, layer by layer; last, as it wraps what steps 2-4 made.

Nothing here imports Lightning or an adapter: the strategy resolves the model's
:class:`~lightning_parallel.parallel.adapter.ModelAdapter` once (``adapters.adapt(module)``) and
hands it to :func:`check_module` before any process group exists and to :func:`parallelize` once
the mesh is built; every question about the model (its plans, layers, roots) goes to that
adapter. Both are testable without a Trainer (a world of 1, or the distributed harness); without
``adapter=`` each resolves one itself (``ModelAdapter.resolve(module)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor, nn

from lightning_parallel.layout import TENSOR_PARALLEL, ParallelLayout
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.parallel.adapter import ModelAdapter
from lightning_parallel.parallel.data import data_axis_mesh, shard_data_axis, uses_data_axis
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.chain_check import check_chain, on_meta
from lightning_parallel.parallel.pipeline.partition import partition_layers, stage_of_layer
from lightning_parallel.parallel.pipeline.plan import PipelinePlan
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, stage_ids_for_rank, validate_schedule
from lightning_parallel.parallel.pipeline.stages import (
    PipelineSplit,
    RemovedLayer,
    layer_names,
    shared_parameters,
    split_module,
)
from lightning_parallel.parallel.precision import fsdp_policy
from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel, resolve_plan, validate_tensor_parallel

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
        loss_fn: the last stage's loss, ``(output, target) -> mean`` or ``-> (loss_sum, num_items)``
            (the module's own, or its Hugging Face model's causal-LM loss terms).
        count_items: ``targets -> items carrying a loss`` matching ``loss_fn``.
        tied: parameters tied across this rank's and other pipeline ranks' stages.
        adapter: the model adapter everything above was asked of (the executors ask it too).
        loss_terms: whether ``loss_fn`` returns ``(loss_sum, num_items)`` terms rather than a mean.
    """

    layout: ParallelLayout
    options: ParallelOptions
    plan: dict[str, ParallelStyle]
    split: Optional[PipelineSplit] = None
    stages: tuple[nn.Module, ...] = ()
    stage_ids: tuple[int, ...] = ()
    last_stage_rank: Optional[int] = None
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    count_items: Optional[Callable[[Any], Tensor]] = None
    tied: tuple[pipeline_tied.TiedCopies, ...] = ()
    adapter: Optional[ModelAdapter] = None
    loss_terms: bool = False

    @property
    def pipelined(self) -> bool:
        return self.split is not None

    @property
    def num_stages(self) -> int:
        return self.split.num_stages if self.split is not None else 1


def check_module(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: Optional[ModelAdapter] = None
) -> dict[str, ParallelStyle]:
    """Everything about ``module`` that can be checked before a process group exists.

    Args:
        module: the whole model (any device, ``meta`` included; the layer-chain check runs
            only on materialised weights).
        layout: the resolved layout.
        options: the run's options.
        adapter: the model's adapter (default: resolved here, ``ModelAdapter.resolve(module)``).

    Returns:
        The resolved tensor-parallel plan (empty without tensor parallelism).

    Raises:
        ValueError: a module that cannot be pipelined (a Hugging Face model without a
            pipeline plan, an encoder-decoder, a layer chain that does not compose to
            ``forward``), too few layers for the stages, a schedule the layout cannot run,
            or a plan the tensor size does not divide.
    """
    adapter = adapter or ModelAdapter.resolve(module)
    if layout.pipeline_parallel_enabled:
        check_pipeline(module, layout, options, adapter=adapter)
    check_activation_checkpointing(module, options.activation_checkpointing, adapter=adapter)
    return check_tensor(module, layout, options, adapter=adapter)


def check_activation_checkpointing(
    module: nn.Module, choice: activation_checkpoint.Choice, *, adapter: Optional[ModelAdapter] = None
) -> None:
    """Refuse an ``activation_checkpointing`` choice (validated by ``check_choice``) that would checkpoint nothing:
    a glob naming no submodule, or ``full``/``selective`` on a module without layers (``adapter.layers()``)."""
    if isinstance(choice, tuple):
        activation_checkpoint.matching_modules(module, choice)
    elif choice != "none" and not (adapter or ModelAdapter.resolve(module)).layers():
        raise ValueError(
            f"activation_checkpointing={choice!r} checkpoints the model's layers, but {type(module).__name__} has "
            "neither pipeline_layers() nor a Hugging Face decoder's layers: define pipeline_layers(), or name the "
            "submodules to checkpoint with a list of globs (activation_checkpointing=['blocks.*'])."
        )


def checkpoint_activations(
    module: nn.Module,
    choice: activation_checkpoint.Choice,
    split: Optional[PipelineSplit] = None,
    *,
    adapter: Optional[ModelAdapter] = None,
) -> list[nn.Module]:
    """Step 3 of :func:`parallelize` (and of the DeepSpeed strategy): checkpoint this rank's layers, or the
    submodules the globs name; returns the checkpointed modules.

    Args:
        module: the whole model, split and tensor-sharded already.
        choice: a validated ``activation_checkpointing`` option.
        split: the pipeline split (None without pipelining).
        adapter: the model's adapter (its layers; made safe to recompute).
    """
    adapter = adapter or ModelAdapter.resolve(module)
    layers = _checkpoint_layers(module, split, adapter) if choice != "none" else []
    chosen = activation_checkpoint.targets(module, choice, layers)
    if chosen:
        adapter.prepare_activation_checkpointing()
    return activation_checkpoint.apply_activation_checkpointing(chosen, selective=choice == "selective")


def _checkpoint_layers(module: nn.Module, split: Optional[PipelineSplit], adapter: ModelAdapter) -> list[nn.Module]:
    """The layers ``full``/``selective`` checkpoint: every pipeline layer, or the adapter's layers."""
    if split is None:
        return adapter.layers()
    return [module.get_submodule(name) for name in split.names]


def check_tensor(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: Optional[ModelAdapter] = None
) -> dict[str, ParallelStyle]:
    """The tensor half of :func:`check_module`; returns the resolved plan (empty without tensor parallelism)."""
    if not layout.tensor_parallel_enabled:
        return {}
    adapter = adapter or ModelAdapter.resolve(module)
    plan = resolve_plan(
        module, options.plan, sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel,
        adapter=adapter,
    )
    validate_tensor_parallel(module, plan, layout.tensor_parallel, adapter=adapter)
    return plan


def check_pipeline(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: Optional[ModelAdapter] = None
) -> PipelinePlan:
    """The pipeline half of :func:`check_module`; returns the adapter's pipeline plan."""
    plan = (adapter or ModelAdapter.resolve(module)).pipeline_plan()
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
    layer_times: Optional[Sequence[float]] = None,
    plan: Optional[PipelinePlan] = None,
) -> tuple[PipelineSplit, list[nn.Module], list[int]]:
    """Cut ``module`` into stages and keep this rank's (step 1 of :func:`parallelize`).

    ``plan`` is the adapter's pipeline plan (default: ``ModelAdapter.resolve(module).pipeline_plan()``).
    """
    plan = plan or ModelAdapter.resolve(module).pipeline_plan()
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
        for stage in stage_ids_for_rank(options.schedule, pipeline_rank, layout.pipeline_parallel, options.stages_per_rank):
            rank_of_stage[stage] = layout.rank_at(coords.data, pipeline_rank, coords.tensor)
    return pipeline_tied.local_tied_copies(split.shared, stage_of_layer(list(split.bounds)), rank_of_stage, rank)


def _tie_copies(module: nn.Module, split: PipelineSplit, stages: list, layout: ParallelLayout,
                options: ParallelOptions, rank: int) -> list:
    tied = tied_copies(split, layout, options, rank)
    pipeline_tied.broadcast_tied(module, tied)  # the copies start equal whatever each rank initialised
    stages[0].tied = tuple(tied)  # the runner finds them there and keeps their gradients summed
    return tied


def _data_axis_layers(module: nn.Module, split: Optional[PipelineSplit], adapter: ModelAdapter) -> list[nn.Module]:
    """Layers that become their own FSDP2 unit: not those holding a tied parameter (their stage root takes it)."""
    if split is None:
        return adapter.layers()
    tied = {index for holders in split.shared for index, _ in holders}
    return [module.get_submodule(name) for index, name in enumerate(split.names) if index not in tied]



def _refuse_parallelized(module: nn.Module) -> None:
    if is_parallelized(module):
        raise ValueError(
            f"{type(module).__name__} was already split or sharded by an earlier run and cannot be parallelised again: "
            "build a fresh module and load the checkpoint into it (ckpt_path=...)."
        )


def _apply_local_plan(module: nn.Module, layout: ParallelLayout, mesh: DeviceMesh, plan: dict,
                      adapter: ModelAdapter) -> None:
    """Step 2 of :func:`parallelize`: the tensor plan's entries for the submodules this rank holds."""
    if layout.tensor_parallel_enabled:
        present = dict(module.named_modules())
        local_plan = {n: s for n, s in plan.items() if n in present and not isinstance(present[n], RemovedLayer)}
        apply_tensor_parallel(module, mesh[TENSOR_PARALLEL], local_plan, adapter)


def _wrap_data_axis(module: nn.Module, layout: ParallelLayout, options: ParallelOptions, meshes: tuple,
                    split: Optional[PipelineSplit], stages: list, precision: str, adapter: ModelAdapter) -> None:
    """Step 5 of :func:`parallelize`: FSDP2 per layer, then per stage (or the model's roots), over the data mesh.

    ``meshes`` is ``(mesh, data_mesh)`` as :func:`parallelize` got them; nothing is wrapped
    when there is no data axis to reduce over (``zero_stage=0`` on one data rank).
    """
    if not uses_data_axis(layout, options.zero_stage):
        return
    dp_mesh = data_axis_mesh(layout, options.zero_stage, *meshes)
    # (4) zero_stage=0 keeps its parameters in their own dtype (no FSDP2 cast); reductions are fp32.
    policy = fsdp_policy(precision, options, layout)
    roots = stages or adapter.data_axis_roots()
    shard_data_axis(_data_axis_layers(module, split, adapter), roots, dp_mesh, options.zero_stage, policy, options.bucket_bytes,
                    options.fsdp_prefetch)


def parallelize(
    module: nn.Module,
    layout: ParallelLayout,
    mesh: DeviceMesh,
    options: ParallelOptions,
    rank: int,
    layer_times: Optional[Sequence[float]] = None,
    on_split: Optional[Callable[[PipelineSplit], Any]] = None,
    precision: str = "32-true",
    data_mesh: Optional[DeviceMesh] = None,
    adapter: Optional[ModelAdapter] = None,
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
        precision: the Trainer's precision name; decides FSDP2's mixed-precision policy.
        data_mesh: ``mesh``'s data axis unflattened to ``(data_replicate, data_shard)``, for ``zero_stage=0``
            with data parallelism and for HSDP (:func:`~lightning_parallel.parallel.data.data_axis_mesh`).
        adapter: the model's adapter, resolved once by the strategy (default: ``ModelAdapter.resolve(module)``).

    Returns:
        A :class:`Parallelized` describing the result.

    Raises:
        ValueError: ``module`` was parallelised before, or any check of :func:`check_module`.
    """
    _refuse_parallelized(module)
    adapter = adapter or ModelAdapter.resolve(module)
    pipe = check_pipeline(module, layout, options, adapter=adapter) if layout.pipeline_parallel_enabled else None
    plan = check_tensor(module, layout, options, adapter=adapter)
    split, stages, stage_ids, last, tied = None, [], [], None, []
    if pipe is not None:
        split, stages, stage_ids = split_pipeline(module, layout, options, rank, layer_times, pipe)
        last, tied = last_stage_rank(layout, options, rank), _tie_copies(module, split, stages, layout, options, rank)
        on_split(split) if on_split is not None else None
    _apply_local_plan(module, layout, mesh, plan, adapter)
    checkpoint_activations(module, options.activation_checkpointing, split, adapter=adapter)
    _wrap_data_axis(module, layout, options, (mesh, data_mesh), split, stages, precision, adapter)
    pipeline_tied.mark_copies(module, tied)  # after FSDP2/TP replaced the parameter objects
    loss_fn, count = (pipe.loss_fn, pipe.count_items) if pipe is not None else (None, None)
    return Parallelized(layout, options, plan, split, tuple(stages), tuple(stage_ids), last, loss_fn, count, tuple(tied),
                        adapter, pipe is not None and pipe.loss_terms)
