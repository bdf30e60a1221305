"""The general strategy: data x context x pipeline x tensor x expert parallelism on one mesh.

Pipeline-only, tensor-only and context-only training are this class with sizes of 1 (:mod:`.presets` names them).
This module is Lightning's lifecycle only: the process group and the run's meshes (``setup_environment``), one call
into the engine (``setup``: :mod:`.build`) and the choice of a step executor (:mod:`.executors`), the after-backward
steps (:mod:`.after_backward`), fault tolerance's hooks (:mod:`.replica_hooks`), and checkpoints
(:mod:`.checkpoints`).
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
from lightning_parallel.checkpoints.dcp.async_writer import AsyncCheckpointWriter, cpu_group_for_async_save
from lightning_parallel.fault_tolerance.options import FaultTolerance
from lightning_parallel.fault_tolerance.replicas import ReplicaGroups
from lightning_parallel.layout import PIPELINE_PARALLEL, ParallelLayout
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.checks import check_checkpoint_format
from lightning_parallel.parallel.compose import Parallelized, check_module
from lightning_parallel.parallel.data import deferred_gradient_sync
from lightning_parallel.parallel.float8.checks import check_float8_device
from lightning_parallel.parallel.float8.convert import precompute_scales
from lightning_parallel.parallel.options import ParallelOptions, options_from
from lightning_parallel.parallel.pipeline.chain_check import on_meta
from lightning_parallel.parallel.precision import check_precision
from lightning_parallel.strategies.hybrid import executors
from lightning_parallel.strategies.hybrid.after_backward import AfterBackward, after_backward_steps, step_with
from lightning_parallel.strategies.hybrid.build import build_parallelized, prepare_optimizers
from lightning_parallel.strategies.hybrid.checkpoints import (
    HybridCheckpointIO,
    checked_load_optimizer_state,
    unwrap_optimizer,
)
from lightning_parallel.strategies.hybrid.clipping import GlobalNormClipping
from lightning_parallel.strategies.hybrid.replica_hooks import replica_hooks
from lightning_parallel.strategies.hybrid.resume_order import resumed_shuffle_notice
from lightning_parallel.strategies.hybrid.run_views import HybridRunViews
from lightning_parallel.strategies.hybrid.timeouts import CollectiveTimeout, names_timeouts
from lightning_parallel.strategies.reduction import ReduceWithoutBarrier

__all__ = ["CollectiveTimeout", "HybridParallelStrategy"]


class HybridParallelStrategy(HybridRunViews, HybridCheckpointIO, ReduceWithoutBarrier, ModelParallelStrategy):
    """Data x context x pipeline x tensor parallelism (experts borrowing data x context ranks) on one mesh.

    ``setup_environment`` builds the process group and the run's :class:`~lightning_parallel.layout.meshes.RunMeshes`
    (``self.meshes``; ``self.device_mesh`` is its run view); ``configure_model`` runs next (on ``meta`` by default);
    ``setup`` calls :func:`~lightning_parallel.parallel.compose.parallelize` once (this rank's pipeline stages, sharded
    by the tensor plan, the data axis wrapped: DDP at ``zero_stage`` 0, FSDP2 at 2/3) and picks the step executor.
    Under pipelining the executor runs the schedule: ``training_step``/``validation_step`` are not called;
    ``train_loss``/``val_loss`` are logged from the pipeline's loss terms (the global-batch mean on every rank).

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
        self._replicas = replica_hooks(self.replica_groups)  # the same hooks with fault tolerance or without
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
        self.async_writer: Optional[AsyncCheckpointWriter] = None  # async_save: the background checkpoint writer

    @property
    @override
    def device_mesh(self) -> Any:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after setup_environment (once processes are initialised).")
        return self._mesh

    @override
    def setup_environment(self) -> None:
        # Validate against the module before any process group exists: errors name the fix
        # instead of surfacing as a hang or a shape error inside a collective.
        self.layout = self.resolve_layout(self.num_processes * self.num_nodes)
        check_checkpoint_format(self.options, self.layout)
        # else checked on meta in setup; a module fit before (then validated) was checked and split already
        if not self._built_for_this_module and not is_overridden("configure_model", self.lightning_module):
            check_module(self.lightning_module, self.layout, self.options, adapter=self.adapter)
        check_precision(self.precision_plugin.precision, self.options, self.layout)
        check_float8_device(self.options.float8, self.root_device)
        # Offloaded gradients live on the CPU: the clipping norm and checkpoint gathers need a CPU backend beside
        # NCCL (torchtitan's "cuda:nccl,cpu:gloo" under FSDP2 CPU offload).
        cpu_too = self.options.offload != "none" and self.root_device.type == "cuda"
        _compat.init_model_parallel_process_group(self, "cuda:nccl,cpu:gloo" if cpu_too else None)
        self._meshes = RunMeshes.build(self.layout, self.root_device.type, self.options.zero_stage,
                                       self.options.timeout)
        self._mesh = self._meshes.run  # 4-D (data, context, pipeline, tensor) under context parallelism
        _compat.set_module_device_mesh(self.lightning_module, self._mesh)
        if self.options.async_save and self.async_writer is None:  # its own gloo group: a collective, every rank
            group = cpu_group_for_async_save(self.options.timeout)
            self.async_writer = AsyncCheckpointWriter(group, pinned=self.root_device.type == "cuda")

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
        if not self._built_for_this_module:  # else fit() then validate/test/predict() with the same Trainer
            self.parallelized = build_parallelized(self, self.lightning_module, trainer)
            self._parallelized_module = weakref.ref(self.lightning_module)
        self._executor = executors.choose_executor(self, self.parallelized)
        self._after_backward = after_backward_steps(self.meshes, self.replica_groups,
                                                    self.options.expert_data_shard)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.parallelized.replicated is not None and fitting:
            self.model = self.parallelized.replicated  # plain DDP: Lightning runs the steps through its forward
        if not isinstance(self.precision_plugin, GlobalNormClipping):
            group = self._meshes.group(PIPELINE_PARALLEL) if self.layout.pipeline_parallel_enabled else None
            self.precision_plugin = GlobalNormClipping(self.precision_plugin, group)
        self.barrier()
        if fitting:
            prepare_optimizers(self, trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat.optimizers_to_device(self.optimizers, self.root_device)
            # the first quorum; a group that is behind heals here
            self._replicas.open(self, trainer, [unwrap_optimizer(o) for o in self.optimizers])

    @override
    def process_dataloader(self, dataloader: object) -> object:
        notice = resumed_shuffle_notice(self.lightning_module.trainer, dataloader, self.layout.shape)
        if notice is not None:  # at the training loader's preparation: once per fit (per reload with reloading)
            rank_zero_info(notice)
        training = self.lightning_module.trainer.training
        return self._replicas.position_loader(dataloader) if training else dataloader

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        inner = super().distributed_sampler_kwargs
        return self._replicas.sampler_kwargs(inner)

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
        self._replicas.before_forward(batch_idx)
        return self._executor.training_step(lambda: super(HybridParallelStrategy, self).training_step(*args, **kwargs),
                                            _batch(args, kwargs), batch_idx)

    @override
    @names_timeouts("validation_step (pipelined or sharded forward)")
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).validation_step(*args, **kwargs)
        return self._executor.evaluation_step(default, _batch(args, kwargs), "val_loss")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).test_step(*args, **kwargs)
        return self._executor.evaluation_step(default, _batch(args, kwargs), "test_loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        default = lambda: super(HybridParallelStrategy, self).predict_step(*args, **kwargs)
        output = self._executor.predict_step(default, _batch(args, kwargs))
        split = self.parallelized.context_split if self.parallelized is not None else None
        return output if split is None else split.gather_outputs(output)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        default = lambda: super(HybridParallelStrategy, self).backward(closure_loss, optimizer, *args, **kwargs)
        return self._executor.backward(default, closure_loss)

    @override
    @names_timeouts("optimizer_step (global-norm clipping, non-finite check)")
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = step_with(self._after_backward, self.lightning_module, optimizer, closure,
                           lambda chained: super(HybridParallelStrategy, self).optimizer_step(optimizer, chained, model,
                                                                                              **kwargs))
        if self.parallelized.float8 is not None and self.parallelized.float8.all_gather:
            precompute_scales(self.lightning_module)  # the next FP8 all-gathers' scales, in one all-reduce
        return result

    @override
    def teardown(self) -> None:
        self._replicas.close()
        writer, self.async_writer = self.async_writer, None
        if writer is not None:  # a save still in flight completes (and is committed) before the run ends
            writer.close()
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


def _batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The batch of a Lightning step call, given by position or by name."""
    return args[0] if args else kwargs.get("batch")
