"""The one place that knows the order in which the parallelisms are applied.

:func:`parallelize` turns a whole module into this rank's share of a data x pipeline x
tensor layout, in torchtitan's order:

1. **pipeline split** -- cut ``pipeline_layers()`` into stages and keep only this rank's
   layers (the others become parameter-free placeholders), so every later step touches
   only what this rank holds and parameter names never change;
   then **FP8** (``float8``, :mod:`.float8`): this rank's chosen Linear layers become torchao's
   ``Float8Linear`` -- before TP and FSDP2, which shard the converted weights (torchao's order);
2. **tensor parallelism** -- ``parallelize_module`` on the submodules this rank holds; it
   must precede FSDP2, which shards the DTensor parameters TP created along one more axis;
   then **context attention** (:mod:`.context`): the adapter replaces the attention this rank holds
   by one that sees the whole sequence across the context group (ring or all-to-all) and says how a
   batch is split along the sequence -- after TP, so a rank attends with the heads it holds; before
   checkpointing, so recomputation replays the context attention too;
3. **activation checkpointing** (``activation_checkpointing``, :mod:`.activation_checkpoint`)
   -- makes this rank's layers (or the submodules a glob list names) recompute their
   forward in backward: after TP, so recomputation runs the sharded layer and its
   collectives; before FSDP2, so FSDP2's units stay the layers and gather their
   parameters around the recomputation as around the forward; then ``compile``
   (:mod:`.compile`): ``torch.compile`` per layer, over what TP and checkpointing made;
4. **mixed-precision policy** (:mod:`.precision`) -- FSDP2's ``MixedPrecisionPolicy``
   from the Trainer's precision and ``param_dtype``/``reduce_dtype``, handed to step 5:
   bf16 all-gathered parameters under ``bf16-mixed`` and fp32 gradient reduce-scatter, but
   fp32 parameters with tensor parallelism, whose tensor-axis gradient all-reduce FSDP2
   would otherwise run in bf16 (pytorch#190626);
5. **data axis** -- FSDP2 ``fully_shard`` per layer and per root (:mod:`.data`): sharded
   for ``zero_stage`` 2/3 (HSDP on a ``(data_replicate, data_shard)`` mesh), replicated for
   ``zero_stage=0`` with data parallelism (shard groups of one rank), so gradients are
   reduced during backward, layer by layer; last, as it wraps what steps 2-4 made. Where
   ``zero_stage=0`` meets no other parallelism (:func:`~.replicated.replicates_plain`), torch's
   DDP takes the axis on plain tensors instead, wrapped around the materialised share (:mod:`.replicated`).

Nothing here imports Lightning or an adapter: the strategy resolves the model's
:class:`~lightning_parallel.parallel.adapter.ModelAdapter` once (``adapters.adapt(module)``) and
hands it to :func:`check_module` before any process group exists and to :func:`parallelize` once
the mesh is built; every question about the model (its plans, layers, roots) goes to that
adapter. Both are testable without a Trainer (a world of 1, or the distributed harness); the adapter is
required here (resolved at the public entry points: ``lightning_parallel.adapters.adapt``), and every mesh
and group comes from one :class:`~lightning_parallel.layout.meshes.RunMeshes`, asked by axis name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.layout import EXPERT_DATA, EXPERT_PARALLEL, TENSOR_PARALLEL, ParallelLayout
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.parallel.adapter import ModelAdapter
from lightning_parallel.parallel.checks import (  # noqa: F401 -- check_module etc. are public here too
    check_activation_checkpointing,
    check_module,
    check_tensor,
    check_whole,
    is_parallelized,
    refuse_parallelized,
)
from lightning_parallel.parallel.compile import compile_layers
from lightning_parallel.parallel.context_and_experts import ExpertAxis, apply_context, apply_experts
from lightning_parallel.parallel.data import data_axis_mesh, shard_data_axis, uses_data_axis
from lightning_parallel.parallel.float8.choice import Float8Choice
from lightning_parallel.parallel.float8.convert import apply_float8, float8_choice
from lightning_parallel.parallel.materialize import InitPlan, Materialization, materialize, meta_init_plan
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.cut import last_stage_rank, split_pipeline, tie_copies
from lightning_parallel.parallel.pipeline.plan import PipelinePlan
from lightning_parallel.parallel.pipeline.stages import (
    PipelineSplit,
    RemovedLayer,
)
from lightning_parallel.parallel.precision import fsdp_policy
from lightning_parallel.parallel.replicated import replicate_module, replicates_plain
from lightning_parallel.parallel.tensor.gradients import resettle_gradients
from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_parallel.parallel.context.plan import SequenceSplit


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
        context_split: how batches split along the sequence and outputs join (None without context parallelism).
        replicated: the ``DistributedDataParallel`` wrapper of the module when the data axis is plain DDP
            (:mod:`.replicated`): the strategy trains through it; None where FSDP2 (or nothing) holds the axis.
        float8: what FP8 training converted and kept (:class:`~.float8.Float8Choice`; None without ``float8``).
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
    context_split: Optional[SequenceSplit] = None
    replicated: Optional[nn.Module] = None
    float8: Optional[Float8Choice] = None

    @property
    def pipelined(self) -> bool:
        return self.split is not None

    @property
    def num_stages(self) -> int:
        return self.split.num_stages if self.split is not None else 1


def checkpoint_activations(
    module: nn.Module,
    choice: activation_checkpoint.Choice,
    split: Optional[PipelineSplit] = None,
    *,
    adapter: ModelAdapter,
) -> list[nn.Module]:
    """Step 3 of :func:`parallelize` (and of the DeepSpeed strategy): checkpoint this rank's layers, or the
    submodules the globs name; returns the checkpointed modules.

    Args:
        module: the whole model, split and tensor-sharded already.
        choice: a validated ``activation_checkpointing`` option.
        split: the pipeline split (None without pipelining).
        adapter: the model's adapter (its layers; made safe to recompute).
    """
    layers = _checkpoint_layers(module, split, adapter) if choice != "none" else []
    chosen = activation_checkpoint.targets(module, choice, layers)
    if chosen:
        adapter.prepare_activation_checkpointing()
    return activation_checkpoint.apply_activation_checkpointing(chosen, selective=choice == "selective")


def _checkpoint_and_compile(module: nn.Module, options: ParallelOptions, split: Optional[PipelineSplit],
                            adapter: ModelAdapter) -> None:
    """Step 3: activation checkpointing, then ``torch.compile`` per layer over it (before FSDP2: :mod:`.compile`)."""
    checkpoint_activations(module, options.activation_checkpointing, split, adapter=adapter)
    if options.compile is not False:  # this rank's layers, not other stages' placeholders
        compile_layers([m for m in _checkpoint_layers(module, split, adapter) if not isinstance(m, RemovedLayer)],
                       options.compile)


def _checkpoint_layers(module: nn.Module, split: Optional[PipelineSplit], adapter: ModelAdapter) -> list[nn.Module]:
    """The layers ``full``/``selective`` checkpoint: every pipeline layer, or the adapter's layers."""
    if split is None:
        return adapter.layers()
    return [module.get_submodule(name) for name in split.names]


def _data_axis_layers(module: nn.Module, split: Optional[PipelineSplit], adapter: ModelAdapter) -> list[nn.Module]:
    """Layers that become their own FSDP2 unit: not those holding a tied parameter (their stage root takes it)."""
    if split is None:
        return adapter.layers()
    tied = {index for holders in split.shared for index, _ in holders}
    return [module.get_submodule(name) for index, name in enumerate(split.names) if index not in tied]


def _apply_local_plan(module: nn.Module, layout: ParallelLayout, mesh: DeviceMesh, plan: dict,
                      adapter: ModelAdapter) -> None:
    """Step 2 of :func:`parallelize`: the tensor plan's entries for the submodules this rank holds."""
    if layout.tensor_parallel_enabled:
        present = dict(module.named_modules())
        local_plan = {n: s for n, s in plan.items() if n in present and not isinstance(present[n], RemovedLayer)}
        apply_tensor_parallel(module, mesh[TENSOR_PARALLEL], local_plan, adapter)


def _wrap_data_axis(module: nn.Module, layout: ParallelLayout, options: ParallelOptions, meshes: tuple,
                    split: Optional[PipelineSplit], stages: list, precision: str, adapter: ModelAdapter,
                    expert_data: Optional[Any] = None) -> None:
    """Step 5 of :func:`parallelize`: FSDP2 per layer, then per stage (or the model's roots), over the data mesh.

    ``meshes`` is ``(mesh, data_mesh)`` as :func:`parallelize` got them; ``expert_data`` the mesh experts are sharded
    over (``expert_data_shard``; None: kept whole). Nothing is wrapped when there is no data axis to reduce over
    (``zero_stage=0`` on one data rank).
    """
    if not uses_data_axis(layout, options.zero_stage) or replicates_plain(layout, options, precision):
        return  # nothing to reduce over, or torch's DDP takes the axis once the share is materialised
    dp_mesh = data_axis_mesh(layout, options.zero_stage, *meshes)
    # (4) zero_stage=0 keeps its parameters in their own dtype (no FSDP2 cast); reductions are fp32.
    policy = fsdp_policy(precision, options, layout)
    roots = stages or adapter.data_axis_roots()
    from lightning_parallel.parallel.experts.sharded import expert_parameters

    experts = {p for _, p in expert_parameters(module)}  # reduced over the expert-data group, not here
    if options.expert_data_shard and expert_data is not None:  # FSDP2 over the expert-data group: children first
        from lightning_parallel.parallel.experts.sharded import shard_experts_over_data

        shard_experts_over_data(module, expert_data, policy)
    shard_data_axis(_data_axis_layers(module, split, adapter), roots, dp_mesh, options.zero_stage, policy,
                    options.bucket_bytes, options.fsdp_prefetch, options.offload, experts)


@dataclass(frozen=True)
class BuildSettings:
    """How :func:`parallelize` builds this rank's share, beyond the meshes and the options.

    Attributes:
        precision: the Trainer's precision name (FSDP2's mixed-precision policy, or DDP's dtype).
        materialization: device and seed for a model built on ``meta`` (required for one).
        layer_times: per-layer seconds for ``partition="time"`` (the same on every rank).
        on_split: called with the pipeline split once it is known (the strategy prints it).
        simulated: leave a ``meta`` model on ``meta`` (``lp-simulate``, :mod:`lightning_parallel.planner.simulation`):
            nothing is allocated or initialised, and where torch's DDP would hold the data axis no wrapper is made
            (its constructor reads parameter values); every other step runs as in a real run.
    """

    precision: str = "32-true"
    materialization: Optional[Materialization] = None
    layer_times: Optional[Sequence[float]] = None
    on_split: Optional[Callable[[PipelineSplit], Any]] = None
    simulated: bool = False

    def device(self, module: nn.Module) -> torch.device:
        """Where ``module`` computes: the materialisation's device, else its parameters' (CPU without any)."""
        if self.materialization is not None:
            return self.materialization.device
        return next(module.parameters(), torch.empty(0)).device


def parallelize(module: nn.Module, *, meshes: RunMeshes, options: ParallelOptions, adapter: ModelAdapter,
                build: BuildSettings = BuildSettings()) -> Parallelized:
    """Split, shard and wrap ``module`` in place for this rank of ``meshes.layout`` (the order: the module
    docstring); returns a :class:`Parallelized` describing the result.

    Args:
        module: the whole model in its training precision, on its device or on ``meta`` (then only this
            rank's share is ever allocated: ``build.materialization`` says where and from which seed).
        meshes: the run's meshes (:class:`~lightning_parallel.layout.meshes.RunMeshes`: its layout, every axis).
        options: the run's options.
        adapter: the model's adapter, resolved once at the entry point (``lightning_parallel.adapters.adapt``).
        build: precision, materialisation, layer times and the split callback.

    Raises:
        ValueError: parallelised before, on ``meta`` without ``build.materialization``, or any :func:`check_module`.
    """
    refuse_parallelized(module)
    layout, mesh = meshes.layout, meshes.run
    init_plan = None if build.simulated else meta_init_plan(module, adapter.init_module, build.materialization)
    pipe, plan = check_whole(module, layout, options, adapter)
    float8 = float8_choice(module, adapter, options, layout, plan, build.device(module)) if options.float8 else None
    split, stages, stage_ids, last, tied = _cut(module, layout, options, meshes.rank, build.layer_times, pipe,
                                                build.on_split)
    plan = apply_float8(module, float8, plan) if float8 is not None else plan  # (1b) before TP and FSDP2
    _apply_local_plan(module, layout, mesh, plan, adapter)
    context_split = apply_context(module, layout, mesh, options, adapter)
    apply_experts(module, layout, _expert_axis(meshes), adapter)
    _checkpoint_and_compile(module, options, split, adapter)
    _wrap_data_axis(module, layout, options, (mesh, meshes.data), split, stages, build.precision, adapter,
                    _expert_data_mesh(meshes, options))
    if init_plan is not None:  # (7) only now is anything allocated: this rank's share
        _materialize_share(module, build.materialization, init_plan, adapter, plan, options.offload)
    pipeline_tied.mark_copies(module, tied)  # after FSDP2/TP/to_empty replaced the parameter objects
    loss_fn, count = (pipe.loss_fn, pipe.count_items) if pipe is not None else (None, None)
    return Parallelized(
        layout=layout, options=options, plan=plan, split=split, stages=tuple(stages), stage_ids=tuple(stage_ids),
        last_stage_rank=last, loss_fn=loss_fn, count_items=count, tied=tuple(tied), adapter=adapter,
        loss_terms=pipe is not None and pipe.loss_terms, context_split=context_split,
        replicated=None if build.simulated else _plain_data_axis(module, layout, options, (mesh, meshes.data),
                                                                 build.precision), float8=float8)


def _expert_axis(meshes: RunMeshes) -> Optional[ExpertAxis]:
    """The experts' mesh and groups (None without expert parallelism); capacity is shared over data x context, as
    one process shares it over the whole batch."""
    if meshes.layout.expert_parallel == 1:
        return None
    from lightning_parallel import _compat

    return ExpertAxis(meshes.mesh(EXPERT_PARALLEL), meshes.loss_group()[0], meshes.group(EXPERT_DATA),
                      _compat.grouped_mm)


def _expert_data_mesh(meshes: RunMeshes, options: ParallelOptions) -> Optional[Any]:
    """The expert-data mesh experts are sharded over (``expert_data_shard``), or None: not asked, or one rank."""
    layout = meshes.layout
    sharded = options.expert_data_shard and layout.expert_parallel > 1 and layout.expert_data > 1
    return meshes.mesh(EXPERT_DATA) if sharded else None


def _plain_data_axis(module: nn.Module, layout: ParallelLayout, options: ParallelOptions, meshes: tuple,
                     precision: str) -> Optional[nn.Module]:
    """Step 5 where torch's DDP holds the axis (:mod:`.replicated`): after step 7, as DDP needs the storage."""
    if not uses_data_axis(layout, options.zero_stage) or not replicates_plain(layout, options, precision):
        return None
    return replicate_module(module, data_axis_mesh(layout, options.zero_stage, *meshes), options.bucket_bytes,
                            options.find_unused_parameters)


def _cut(module: nn.Module, layout: ParallelLayout, options: ParallelOptions, rank: int,
         layer_times: Optional[Sequence[float]], pipe: Optional[PipelinePlan],
         on_split: Optional[Callable[[PipelineSplit], Any]]) -> tuple:
    """Step 1: ``(split, stages, stage_ids, last stage's rank, tied copies)``; empty without pipelining."""
    if pipe is None:
        return None, [], [], None, []
    split, stages, stage_ids = split_pipeline(module, layout, options, rank, layer_times, pipe)
    last, tied = last_stage_rank(layout, options, rank), tie_copies(module, split, stages, layout, options, rank)
    on_split(split) if on_split is not None else None
    return split, stages, stage_ids, last, tied


def _materialize_share(module: nn.Module, materialization: Materialization, init_plan: InitPlan,
                       adapter: ModelAdapter, plan: dict, offload: str = "none") -> None:
    """Step 7: allocate and initialise this rank's share; TP's gradient hooks went with the old parameter objects.

    Under FSDP2's CPU offload the parameters are allocated on the host, where the policy keeps them (FSDP2 refuses
    device parameters at the first forward), and the buffers, which FSDP2 does not manage, on the device they
    compute on (torchtitan's ``init_device="cpu"``, ``buffer_device``)."""
    host = offload != "none" and materialization.device.type != "cpu"
    materialize(module, torch.device("cpu") if host else materialization.device, init_plan, adapter.init_module)
    if host:
        for owner in module.modules():
            for name, buffer in list(owner.named_buffers(recurse=False)):
                setattr(owner, name, buffer.to(materialization.device))
    resettle_gradients(module, plan)
