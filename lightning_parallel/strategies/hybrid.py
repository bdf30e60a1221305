"""The general strategy: data x pipeline x tensor parallelism on one 3-D DeviceMesh.

Pipeline-only, tensor-only and data-only training are this class with sizes of 1
(:mod:`lightning_parallel.strategies.presets` names them). This module is Lightning's
lifecycle only: the process group and mesh (``setup_environment``), one call to
:func:`~lightning_parallel.parallel.compose.parallelize` and the choice of a step executor
(``setup``), collectives, and checkpoint delegation to :mod:`lightning_parallel.checkpoints`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel import _compat
from lightning_parallel.adapters import ModelAdapter
from lightning_parallel.fault_tolerance.options import FaultTolerance
from lightning_parallel.fault_tolerance.replicas import ReplicaGroups
from lightning_parallel.layout import PIPELINE_PARALLEL, ParallelLayout
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import BuildSettings, Parallelized, check_module, parallelize
from lightning_parallel.parallel.data import deferred_gradient_sync
from lightning_parallel.parallel.local_step import step_on_local_shards
from lightning_parallel.parallel.materialize import Materialization
from lightning_parallel.parallel.options import ParallelOptions, options_from
from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.chain_check import on_meta
from lightning_parallel.parallel.pipeline.stages import PipelineSplit
from lightning_parallel.parallel.precision import check_precision
from lightning_parallel.strategies import executors
from lightning_parallel.strategies.clipping import GlobalNormClipping
from lightning_parallel.strategies.hybrid_checkpoints import (
    HybridCheckpointIO,
    checked_load_optimizer_state,
    unwrap_optimizer,
)
from lightning_parallel.strategies.layer_timing import agreed_layer_times
from lightning_parallel.strategies.reduction import ReduceWithoutBarrier
from lightning_parallel.strategies.resolved_adapter import resolved_adapter
from lightning_parallel.strategies.after_backward import AfterBackward, after_backward_steps
from lightning_parallel.strategies.resume_order import resumed_shuffle_notice
from lightning_parallel.strategies.timeouts import CollectiveTimeout, names_timeouts

__all__ = ["CollectiveTimeout", "HybridParallelStrategy"]


class HybridParallelStrategy(HybridCheckpointIO, ReduceWithoutBarrier, ModelParallelStrategy):
    """Data x context x pipeline x tensor parallelism (experts borrowing data x context ranks) on one mesh.

    Lightning's lifecycle only: ``setup_environment`` builds the process group and the run's
    :class:`~lightning_parallel.layout.meshes.RunMeshes` (``self.meshes``; ``self.device_mesh`` is its run view);
    ``configure_model`` runs next (on ``meta`` by default); ``setup`` resolves the model's adapter once and calls
    :func:`~lightning_parallel.parallel.compose.parallelize`, which splits the module into this rank's pipeline
    stages, shards them by the tensor plan, and wraps the data axis (``zero_stage`` 0: DDP or replicated FSDP2;
    2/3: FSDP2 sharding), then picks the step executor. Under pipelining the executor runs the schedule: the module's
    ``training_step``/``validation_step`` are not called; ``train_loss``/``val_loss`` are logged from its pipeline
    loss terms (the global-batch mean, the same on every rank); ``predict_step`` returns outputs on every rank.
    Checkpoints: :class:`~lightning_parallel.strategies.hybrid_checkpoints.HybridCheckpointIO`.

    Args:
        options: see :class:`~lightning_parallel.parallel.options.ParallelOptions` (sizes, ``zero_stage``,
            schedule, tensor-parallel plan, precision, checkpoint format, timeout, ...): one
            ``ParallelOptions``, or its fields as keywords (``option_kwargs``); both only where they agree
            (validated at construction into ``strategy.options``; an unknown name names the closest valid one).
        process_group_backend: ``gloo``/``nccl``; default by device.
        load_optimizer_state: ``ckpt_path``'s optimizer state is restored (default), resharded onto this layout, or
            the load is refused when it cannot be exactly. ``False``: load everything else and start the optimizer
            afresh, with a warning.
        fault_tolerance: a :class:`~lightning_parallel.fault_tolerance.FaultTolerance` (or a mapping of its fields):
            this run is one replica group of several that survive each other's loss (torchft). Default: off.
        **option_kwargs: fields of ``ParallelOptions`` by name, e.g. ``pipeline_parallel_size=2, zero_stage=2``.
    """

    strategy_name = "hybrid_parallel"

    def __init__(self, options: Optional[ParallelOptions] = None, *, process_group_backend: Optional[str] = None,
                 load_optimizer_state: bool = True, fault_tolerance: Any = None, **option_kwargs: Any) -> None:
        self.load_optimizer_state = checked_load_optimizer_state(load_optimizer_state)
        ft = FaultTolerance.from_config(fault_tolerance)
        self.replica_groups: Optional[ReplicaGroups] = ReplicaGroups(ft) if ft is not None else None
        self.options = options_from(options, option_kwargs, type(self).__name__)
        super().__init__(
            data_parallel_size=self.options.data_parallel_size,
            tensor_parallel_size=self.options.tensor_parallel_size,
            save_distributed_checkpoint=self.options.save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=self.options.timeout,
        )
        self.layout: Optional[ParallelLayout] = None
        self.parallelized: Optional[Parallelized] = None
        self._mesh: Any = None
        self._meshes: Optional[RunMeshes] = None  # every mesh and group of the run, asked by axis name
        self._parallelized_module: Optional[weakref.ref] = None
        self._executor: executors.DirectExecutor = executors.DirectExecutor()
        self._after_backward: list[AfterBackward] = []

    # --- layout ----------------------------------------------------------------------
    def resolve_layout(
        self, world_size: int, names: Optional[dict[str, str]] = None, num_nodes: Optional[int] = None
    ) -> ParallelLayout:
        """The data x pipeline x tensor layout for ``world_size`` ranks (no processes needed).

        Args:
            world_size: processes in the run.
            names: how errors spell the settings (default: this strategy's argument names).
            num_nodes: nodes in the run, for the messages (default: the strategy's).
        """
        return self.options.layout(world_size, names, num_nodes or self.num_nodes)

    def startup_rows(self, layout: ParallelLayout) -> dict[str, str]:
        """Strategy rows of the start-up table (see :mod:`lightning_parallel.cli.report`)."""
        from lightning_parallel.strategies.startup_rows import layout_rows

        return layout_rows(self.options, layout, str(self.precision_plugin.precision))

    @property
    @override
    def device_mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after setup_environment (once processes are initialised).")
        return self._mesh

    @property
    def meshes(self) -> RunMeshes:
        """Every mesh and process group of the run, asked by axis name (after ``setup_environment``)."""
        if self._meshes is None:
            raise RuntimeError("The meshes exist only after setup_environment (once processes are initialised).")
        return self._meshes

    def loss_group(self) -> tuple[Optional[Any], int]:
        """``(group, size)`` of the ranks a loss is averaged over (data x context; see ``RunMeshes.loss_group``)."""
        return self.meshes.loss_group()

    @property
    def pipeline_split(self) -> Optional[PipelineSplit]:
        """Which layers each pipeline stage owns (None without pipelining or before ``setup``)."""
        return getattr(self.parallelized, "split", None)

    @property
    def pipeline_runner(self) -> Any:  # the executor's PipelineRunner (parallel/pipeline/runner.py); None without
        return getattr(self._executor, "runner", None)

    # --- Lightning lifecycle ---------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # Validate against the module before any process group exists: errors name the fix
        # instead of surfacing as a hang or a shape error inside a collective.
        self.layout = self.resolve_layout(self.num_processes * self.num_nodes)
        if self.layout.pipeline_parallel_enabled and not self.options.save_distributed_checkpoint:
            raise ValueError("save_distributed_checkpoint=False gathers one file on rank 0, which holds only the first "
                             "pipeline stage: keep save_distributed_checkpoint=True under pipeline parallelism "
                             "(the folder loads under any layout).")
        already = self._parallelized_module is not None and self._parallelized_module() is self.lightning_module
        # else checked on meta in setup; a module fit before (then validated) was checked and split already
        if not already and not is_overridden("configure_model", self.lightning_module):
            check_module(self.lightning_module, self.layout, self.options, adapter=self.adapter)
        check_precision(self.precision_plugin.precision, self.options, self.layout)
        # Offloaded gradients live on the CPU: the clipping norm and checkpoint gathers need a CPU backend beside
        # NCCL (torchtitan's "cuda:nccl,cpu:gloo" under FSDP2 CPU offload).
        cpu_too = self.options.offload != "none" and self.root_device.type == "cuda"
        _compat.init_model_parallel_process_group(self, "cuda:nccl,cpu:gloo" if cpu_too else None)
        self._meshes = RunMeshes.build(self.layout, self.root_device.type, self.options.zero_stage)
        self._mesh = self._meshes.run  # 4-D (data, context, pipeline, tensor) under context parallelism
        _compat.set_module_device_mesh(self.lightning_module, self._mesh)

    @property
    def adapter(self) -> ModelAdapter:
        """What answers for the module being trained (``lightning_parallel.adapters.adapt``), resolved once per module
        and again in ``setup``, after ``configure_model`` may have built the model inside it."""
        return resolved_adapter(self)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Modules created in ``configure_model`` or ``trainer.init_module()`` are built on ``meta`` unless
        ``empty_init=False``: ``setup`` then allocates only this rank's share (:mod:`~.parallel.materialize`)."""
        with super().tensor_init_context(empty_init=empty_init is not False):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        # Precision and device first: converting or moving after parallelisation would
        # replace the DTensor parameters and drop the gradient-placement hooks TP puts on them.
        self.model = self.precision_plugin.convert_module(self.model)
        if not on_meta(self.model):  # a meta model gets its device when materialised, share by share
            self.model_to_device()
        self._parallelize(self.lightning_module, trainer)
        self._executor = executors.choose_executor(self, self.parallelized)
        self._after_backward = after_backward_steps(self.meshes, self.replica_groups)
        if self.parallelized.replicated is not None and trainer.state.fn == TrainerFn.FITTING:
            self.model = self.parallelized.replicated  # plain DDP: Lightning runs the steps through its forward
        if not isinstance(self.precision_plugin, GlobalNormClipping):
            group = self._meshes.group(PIPELINE_PARALLEL) if self.layout.pipeline_parallel_enabled else None
            self.precision_plugin = GlobalNormClipping(self.precision_plugin, group)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            optimizers, split = [unwrap_optimizer(o) for o in self.optimizers], self.parallelized.split
            step_on_local_shards(optimizers)  # element-wise updates of DTensor parameters on their local tensors
            if split is not None and split.shared:  # the same on every rank: a safe collective
                pipeline_tied.check_tied_optimizer_groups(self.lightning_module, self.parallelized.tied, optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
            if self.replica_groups is not None:  # the first quorum; a group that is behind heals here
                self.replica_groups.open(self, trainer, [unwrap_optimizer(o) for o in self.optimizers])

    def _parallelize(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        if self._parallelized_module is not None and self._parallelized_module() is module:
            return  # fit() then validate/test/predict() with the same Trainer: already split and sharded
        layout, adapter = self.layout, resolved_adapter(self, refresh=True)  # after configure_model: what it built
        timed = layout.pipeline_parallel_enabled and self.options.partition == "time"
        if timed and on_meta(module):
            raise ValueError("partition='time' times each layer, but the model is on the meta device (built in "
                             "configure_model): use partition='parameters' or explicit cut points.")
        times = agreed_layer_times(adapter, trainer, self.options.microbatches, self.root_device,
                                   self.world_size) if timed else None
        seed = int(self.broadcast(torch.initial_seed()))  # meta init: one seed on every rank, seeded or not
        if not on_meta(module) and (layout.world_size > layout.data_parallel or self.options.zero_stage == 3):
            rank_zero_info(f"lightning_parallel: {type(module).__name__} was built with storage, so every rank held "
                           "the whole model before the split; build it in configure_model() to hold only its share.")
        build = BuildSettings(str(self.precision_plugin.precision), Materialization(self.root_device, seed), times,
                              self._print_split)
        self.parallelized = parallelize(module, meshes=self._meshes, options=self.options, adapter=adapter,
                                        build=build)
        self._parallelized_module = weakref.ref(module)

    def _print_split(self, split: PipelineSplit) -> None:
        if self.global_rank == 0:
            from lightning_parallel.runtime.console import print_table

            print_table("lightning_parallel: pipeline split", list(split.describe().items()))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        notice = resumed_shuffle_notice(self.lightning_module.trainer, dataloader, self.layout.shape)
        if notice is not None:  # at the training loader's preparation: once per fit (per reload with reloading)
            rank_zero_info(notice)
        trainer = self.lightning_module.trainer
        if self.replica_groups is not None and trainer.training:
            return self.replica_groups.position_loader(dataloader)
        return dataloader

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        inner = super().distributed_sampler_kwargs
        return inner if self.replica_groups is None else self.replica_groups.sampler_kwargs(inner)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Lightning's move to the device; then, under context parallelism, this rank's share of every sequence
        (``predict_step`` joins the outputs again)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        split = self.parallelized.context_split if self.parallelized is not None else None
        return batch if split is None else split.split_batch(batch)

    # --- steps: delegated to the executor chosen in setup --------------------------------
    @override
    @names_timeouts("training_step (pipeline schedule send/recv, tensor-parallel and FSDP collectives)")
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if self.replica_groups is not None:
            self.replica_groups.before_forward(batch_idx)
        return self._executor.training_step(lambda: super(HybridParallelStrategy, self).training_step(*args, **kwargs),
                                            args[0] if args else kwargs.get("batch"), batch_idx)

    @override
    @names_timeouts("validation_step (pipelined or sharded forward)")
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).validation_step(*args, **kwargs)
        return self._executor.evaluation_step(default, args[0] if args else kwargs.get("batch"), "val_loss")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).test_step(*args, **kwargs)
        return self._executor.evaluation_step(default, args[0] if args else kwargs.get("batch"), "test_loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).predict_step(*args, **kwargs)
        output = self._executor.predict_step(default, args[0] if args else kwargs.get("batch"))
        split = self.parallelized.context_split if self.parallelized is not None else None
        return output if split is None else split.gather_outputs(output)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        default = lambda: super(HybridParallelStrategy, self).backward(closure_loss, optimizer, *args, **kwargs)
        return self._executor.backward(default, closure_loss)

    @override
    @names_timeouts("optimizer_step (global-norm clipping, non-finite check)")
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        steps = self._after_backward  # strategies/after_backward.py: experts' reduction, replica commit
        if not steps:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_steps() -> Any:
            result = closure()
            for step in steps:
                step(self.lightning_module, unwrap_optimizer(optimizer))
            return result

        try:
            return super().optimizer_step(optimizer, closure_then_steps, model, **kwargs)
        finally:
            for step in steps:
                step.after_step()

    @override
    def teardown(self) -> None:
        if self.replica_groups is not None:
            self.replica_groups.close()
        self.model = self.lightning_module  # unwrap DDP (a no-op otherwise), as Lightning's DDPStrategy does
        super().teardown()

    @override
    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation micro-steps: no data-axis reduction until the window's last backward.

        See :func:`~lightning_parallel.parallel.data.deferred_gradient_sync` (what each ZeRO stage skips). Under
        pipelining ``PipelineStage`` syncs at every schedule's end (still exact); raise ``microbatches`` instead.
        """
        with deferred_gradient_sync(self.model, self.options.zero_stage, self.layout.hsdp_enabled):
            yield

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="data x pipeline x tensor parallelism (lightning_parallel)"
            )
