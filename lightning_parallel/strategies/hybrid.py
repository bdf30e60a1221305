"""The general strategy: data x pipeline x tensor parallelism on one 3-D DeviceMesh.

Pipeline-only, tensor-only and data-only training are this class with sizes of 1
(:mod:`lightning_parallel.strategies.presets` names them). The Lightning face lives
here; splitting and sharding live in :mod:`lightning_parallel.parallel`.

Note:
    Composition order is torchtitan's: cut the model into pipeline stages first (each
    rank keeps only its layers), then shard each stage's layers over the tensor group
    (DTensor), then shard or replicate over the data group (FSDP2 ``fully_shard`` for
    ``zero_stage`` 2/3, a gradient all-reduce for 0). Tensor parallelism must come before
    FSDP because FSDP2 shards the DTensor parameters TP created along one more mesh axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parallel.layout import (
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    ParallelLayout,
    Size,
    check_size,
)
from lightning_parallel.parallel import gradients
from lightning_parallel.parallel.partition import METHODS, measure_layer_times, partition_layers
from lightning_parallel.protocol import require_pipeline_module, split_batch

ZERO_STAGES = (0, 2, 3)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the strategy's timeout: another rank died or stalled."""


def _names_timeouts(phase: str) -> Any:
    """Re-raise a collective timeout inside ``phase`` naming this rank, its mesh position and the step.

    Note:
        gloo reports only "Timed out waiting 5000ms for recv operation"; the collective sits
        deep inside DTensor, FSDP2 or the pipeline schedule, so the strategy adds what it
        knows: which rank, where in the mesh, which phase of which step.
    """

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def run(self: "HybridParallelStrategy", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except RuntimeError as error:
                if isinstance(error, CollectiveTimeout) or "timed out" not in str(error).lower():
                    raise
                raise CollectiveTimeout(self._timeout_message(phase, error)) from error

        return run

    return wrap


def _plain(value: Any) -> Any:
    """Hydra passes DictConfig/ListConfig; the machinery wants plain containers."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


class HybridParallelStrategy(ModelParallelStrategy):
    """Data x pipeline x tensor parallelism for modules that follow the suite's protocol.

    Ranks form a mesh ``(data_parallel, pipeline_parallel, tensor_parallel)``, tensor
    innermost. The module is cut into ``pipeline_parallel_size x stages_per_rank`` stages of
    its ``pipeline_layers()``, each stage's layers are sharded by ``tensor_parallel_plan()``
    (plus ``plan``), and the data dimension either averages gradients (``zero_stage=0``) or
    shards them with FSDP2 (``2``: gradients and optimizer state; ``3``: parameters too).
    ``configure_model`` still runs first, with ``self.device_mesh`` available, for anything a
    plan cannot say.

    Under pipeline parallelism the strategy runs the schedule itself: the module's
    ``training_step``/``validation_step`` are not called; ``train_loss``/``val_loss`` are
    logged from ``pipeline_loss`` (the global-batch mean, the same on every rank), and
    ``predict_step`` returns the model outputs on every rank.

    Args:
        data_parallel_size: replicas (``"auto"``: what the other sizes leave of the world).
        pipeline_parallel_size: pipeline ranks.
        tensor_parallel_size: ranks sharing each layer.
        zero_stage: 0 (replicated, gradient all-reduce), 2 or 3 (FSDP2 over the data axis).
        microbatches: micro-batches per batch for the pipeline schedule.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``,
            ``interleaved_zero_bubble``, ``zbv`` or ``dualpipev``.
        partition: ``uniform``, ``parameters``, ``time`` or a list of cut points.
        stages_per_rank: pipeline stages per rank (2+ for interleaved/zero-bubble schedules).
        sequence_parallel: shard norms/dropout activations along the sequence (needs a plan
            that declares them).
        loss_parallel: keep the LM head's output vocab-sharded and compute a vocab-parallel
            cross-entropy.
        plan: extra or overriding tensor-parallel plan entries (glob -> style name; None removes).
        save_distributed_checkpoint: sharded DCP folder (True) or one consolidated file.
        process_group_backend: ``gloo``/``nccl``; default by device.
        timeout: collective timeout: a dead rank fails the run instead of hanging it.
    """

    strategy_name = "hybrid_parallel"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        pipeline_parallel_size: Size = 1,
        tensor_parallel_size: Size = 1,
        zero_stage: int = 0,
        microbatches: int = 4,
        schedule: str = "1f1b",
        partition: Union[str, list[int]] = "parameters",
        stages_per_rank: int = 1,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        plan: Optional[Mapping[str, Any]] = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        from lightning_parallel.parallel.pipeline import validate_schedule

        for name, value in (
            ("data_parallel_size", data_parallel_size),
            ("pipeline_parallel_size", pipeline_parallel_size),
            ("tensor_parallel_size", tensor_parallel_size),
        ):
            check_size(name, value)
        if zero_stage not in ZERO_STAGES:
            raise ValueError(
                f"zero_stage={zero_stage!r} is not supported: use 0 (replicate), 2 (FSDP2 shards gradients and optimizer "
                "state) or 3 (parameters too). For ZeRO-1 use strategy=deepspeed_zero1."
            )
        partition = _plain(partition)
        if isinstance(partition, str) and partition not in METHODS:
            raise ValueError(
                f"Unknown partition {partition!r}: use one of {METHODS} or a list of cut points such as [3, 5]."
            )
        if loss_parallel and tensor_parallel_size == 1:
            raise ValueError(
                "loss_parallel=True needs tensor_parallel_size > 1 (the vocabulary is sharded over the tensor group)."
            )
        if sequence_parallel and tensor_parallel_size == 1:
            raise ValueError("sequence_parallel=True needs tensor_parallel_size > 1.")
        pp_known = pipeline_parallel_size if isinstance(pipeline_parallel_size, int) else 1
        validate_schedule(schedule, pp_known, stages_per_rank, microbatches)
        self._pipeline_parallel_size = pipeline_parallel_size
        self.zero_stage = zero_stage
        self.microbatches = microbatches
        self.schedule = schedule
        self.partition = partition
        self.stages_per_rank = stages_per_rank
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.plan_overrides = _plain(plan)
        self.layout: Optional[ParallelLayout] = None
        self.pipeline_split = None
        self._pipeline = None
        self._tp_plan: dict = {}

    # --- layout ----------------------------------------------------------------------
    def resolve_layout(self, world_size: int) -> ParallelLayout:
        """The data x pipeline x tensor layout for ``world_size`` ranks (no processes needed)."""
        return ParallelLayout.resolve(
            world_size, self._data_parallel_size, self._pipeline_parallel_size, self._tensor_parallel_size
        )

    def startup_rows(self, layout: ParallelLayout) -> dict[str, str]:
        """Strategy rows of the start-up table (see :mod:`lightning_parallel.report`)."""
        from lightning_parallel.report import rank_map_rows

        rows = {}
        if layout.pipeline_parallel_enabled:
            rows["pipeline"] = (
                f"schedule {self.schedule}, {self.microbatches} micro-batches, {layout.pipeline_parallel * self.stages_per_rank} "
                f"stages ({self.stages_per_rank}/rank), partition {self.partition}"
            )
        if layout.tensor_parallel_enabled:
            rows["tensor"] = f"sequence_parallel={self.sequence_parallel}, loss_parallel={self.loss_parallel}"
        rows["data"] = {
            0: "replicated, gradient all-reduce",
            2: "FSDP2: gradients + optimizer state sharded",
            3: "FSDP2: parameters, gradients + optimizer state sharded",
        }[self.zero_stage]
        rows.update(rank_map_rows(layout))
        return rows

    def _check_module(self, module: pl.LightningModule, layout: ParallelLayout) -> None:
        """Everything that can be checked before a process group exists."""
        from lightning_parallel.parallel.pipeline import validate_schedule
        from lightning_parallel.parallel.tensor import resolve_plan, validate_tensor_parallel

        if layout.pipeline_parallel_enabled:
            require_pipeline_module(module)
            validate_schedule(self.schedule, layout.pipeline_parallel, self.stages_per_rank, self.microbatches)
            num_layers, num_stages = len(module.pipeline_layers()), layout.pipeline_parallel * self.stages_per_rank
            if num_layers < num_stages:
                raise ValueError(
                    f"{type(module).__name__} has {num_layers} pipeline layers, fewer than the {num_stages} stages of "
                    f"pipeline_parallel_size={layout.pipeline_parallel} x stages_per_rank={self.stages_per_rank}: lower them."
                )
        if layout.tensor_parallel_enabled:
            self._tp_plan = resolve_plan(
                module, self.plan_overrides, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel
            )
            validate_tensor_parallel(module, self._tp_plan, layout.tensor_parallel)

    # --- Lightning lifecycle ---------------------------------------------------------
    def setup_environment(self) -> None:
        # Validate against the module before any process group exists: errors name the fix
        # instead of surfacing as a hang or a shape error inside a collective.
        self.layout = self.resolve_layout(self.num_processes * self.num_nodes)
        if self.layout.pipeline_parallel_enabled and not self._save_distributed_checkpoint:
            raise ValueError(
                "save_distributed_checkpoint=False gathers one file on rank 0, which holds only the first pipeline "
                "stage: keep save_distributed_checkpoint=True under pipeline parallelism (the folder loads under any layout)."
            )
        self._check_module(self.lightning_module, self.layout)
        self._setup_distributed()
        self._device_mesh = self.layout.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        # Precision and device first: converting or moving after parallelisation would
        # replace the DTensor parameters and drop the gradient-placement hooks TP puts on them.
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize(self.lightning_module, trainer)
        self._install_gradient_clipping()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        layout, mesh = self.layout, self.device_mesh
        settings = (layout, self.schedule, self.stages_per_rank, self.zero_stage, self.sequence_parallel, self.loss_parallel)
        applied = getattr(module, "_lightning_parallel_applied", None)
        if applied is not None:
            # fit() then test()/predict() on the same module: it is already split and sharded.
            if applied["settings"] != settings:
                raise ValueError(
                    f"This module was already parallelised for {applied['settings'][0].describe()} with other settings; "
                    "it cannot be re-split. Build a fresh module and load the checkpoint into it (ckpt_path=...)."
                )
            self.pipeline_split = applied["split"]
            if applied["stages"] is not None:
                self._build_pipeline(module, applied["stages"], applied["stage_ids"])
            return
        stages = stage_ids = None
        if layout.pipeline_parallel_enabled:
            stages, stage_ids = self._split_pipeline(module, trainer)
        if layout.tensor_parallel_enabled:
            from lightning_parallel.parallel.pipeline import RemovedLayer
            from lightning_parallel.parallel.tensor import apply_tensor_parallel

            present = dict(module.named_modules())
            local_plan = {
                n: s for n, s in self._tp_plan.items() if n in present and not isinstance(present[n], RemovedLayer)
            }
            apply_tensor_parallel(module, mesh[TENSOR_PARALLEL], local_plan)
        if self.zero_stage:
            self._fully_shard(module, stages)
        if stages is not None:
            self._build_pipeline(module, stages, stage_ids)
        module._lightning_parallel_applied = {"settings": settings, "split": self.pipeline_split, "stages": stages, "stage_ids": stage_ids}

    def _split_pipeline(self, module: pl.LightningModule, trainer: pl.Trainer) -> tuple[list[nn.Module], list[int]]:
        from lightning_parallel.parallel.pipeline import split_module, stage_ids_for_rank

        layout = self.layout
        layers = module.pipeline_layers()
        num_stages = layout.pipeline_parallel * self.stages_per_rank
        times = self._agreed_layer_times(module, layers, trainer) if self.partition == "time" else None
        bounds = partition_layers(layers, num_stages, self.partition, times)
        coords = layout.coordinates(self.global_rank)
        stage_ids = stage_ids_for_rank(self.schedule, coords.pipeline, layout.pipeline_parallel, self.stages_per_rank)
        self.pipeline_split, stages = split_module(module, layers, bounds, stage_ids)
        if self.global_rank == 0:
            from lightning_parallel.report import print_table

            print_table("lightning_parallel: pipeline split", list(self.pipeline_split.describe().items()))
        return stages, stage_ids

    def _agreed_layer_times(
        self, module: pl.LightningModule, layers: list[nn.Module], trainer: pl.Trainer
    ) -> list[float]:
        """Per-layer forward+backward seconds, averaged over all ranks so every rank cuts the same way."""
        try:
            batch = next(iter(trainer.fit_loop._data_source.dataloader()))
        except Exception as error:  # noqa: BLE001 - any failure here means: no sample batch
            raise ValueError(
                "partition='time' measures layers on a training batch, but none could be loaded: use 'parameters'."
            ) from error
        inputs, _ = split_batch(module, batch)
        sample = inputs[: max(1, inputs.shape[0] // self.microbatches)].to(self.root_device)
        times = torch.tensor(measure_layer_times(layers, sample), dtype=torch.float64)
        dist.all_reduce(times)
        return (times / self.world_size).tolist()

    def _fully_shard(self, module: pl.LightningModule, stages: Optional[list[nn.Module]]) -> None:
        from torch.distributed.fsdp import fully_shard

        from lightning_parallel.parallel.pipeline import RemovedLayer

        dp_mesh = self.device_mesh[DATA_PARALLEL]
        reshard = self.zero_stage == 3
        layers = module.pipeline_layers() if callable(getattr(module, "pipeline_layers", None)) else []
        for layer in layers:
            if not isinstance(layer, RemovedLayer) and any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
        # The root unit takes whatever parameters the layers did not. Under pipelining the
        # stage modules are the roots, so PipelineStage sees an FSDPModule and controls
        # gradient sync per micro-batch.
        for root in stages if stages is not None else [module]:
            fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard)

    def _build_pipeline(self, module: pl.LightningModule, stages: list[nn.Module], stage_ids: list[int]) -> None:
        from lightning_parallel.parallel.pipeline import PipelineRunner, stage_ids_for_rank

        layout = self.layout
        num_stages = layout.pipeline_parallel * self.stages_per_rank
        coords = layout.coordinates(self.global_rank)
        last_pp_rank = next(
            r
            for r in range(layout.pipeline_parallel)
            if num_stages - 1 in stage_ids_for_rank(self.schedule, r, layout.pipeline_parallel, self.stages_per_rank)
        )
        self._pipeline = PipelineRunner(
            stages,
            stage_ids,
            num_stages,
            self.schedule,
            self.microbatches,
            loss_fn=module.pipeline_loss,
            device=self.root_device,
            group=self.device_mesh[PIPELINE_PARALLEL].get_group(),
            last_stage_rank=layout.rank_at(coords.data, last_pp_rank, coords.tensor),
        )

    # --- steps -----------------------------------------------------------------------
    @contextmanager
    def _loss_context(self) -> Iterator[None]:
        from lightning_parallel.parallel.tensor import loss_parallel_context

        with loss_parallel_context(self.loss_parallel) if self.loss_parallel else nullcontext():
            yield

    def _data_parallel_mean(self, value: Tensor) -> Tensor:
        if self.layout.data_parallel_enabled:
            value = value.clone()
            dist.all_reduce(value, group=self.device_mesh[DATA_PARALLEL].get_group())
            value /= self.layout.data_parallel
        return value

    @staticmethod
    def _plain_loss(output: Any) -> Any:
        """A loss computed under loss_parallel is a replicated DTensor; Lightning needs a tensor.

        ``full_tensor()`` of a replicated DTensor is differentiable and communication-free.
        """
        from torch.distributed.tensor import DTensor

        if isinstance(output, DTensor):
            return output.full_tensor()
        if isinstance(output, Mapping) and isinstance(output.get("loss"), DTensor):
            return {**output, "loss": output["loss"].full_tensor()}
        return output

    def _timeout_message(self, phase: str, error: BaseException) -> str:
        coords = self.layout.coordinates(self.global_rank) if self.layout else None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        step = trainer.global_step if trainer is not None else "?"
        return (
            f"Rank {self.global_rank} (data, pipeline, tensor = {tuple(coords) if coords else '?'}) timed out after "
            f"{self._timeout} in {phase} at global step {step}: another rank died or stalled. Check the other ranks' logs; "
            f"raise strategy.timeout if a step legitimately takes longer. ({error})"
        )

    @_names_timeouts("training_step (pipeline schedule send/recv, tensor-parallel and FSDP collectives)")
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._loss_context():
                return self._plain_loss(super().training_step(*args, **kwargs))
        module = self.lightning_module
        inputs, targets = split_batch(module, args[0])
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if batch_idx % module.trainer.accumulate_grad_batches == 0:
            # First batch of an accumulation window: Lightning will zero the gradients only
            # after this step has run backward, so start the window from zero here.
            for param in module.parameters():
                param.grad = None
        with self.precision_plugin.train_step_context(), self._loss_context():
            loss = self._pipeline.train_step(inputs, targets, loss_scale=1.0 / module.trainer.accumulate_grad_batches)
        self._park_gradients()
        loss = self._data_parallel_mean(loss)
        module.log("train_loss", loss, prog_bar=True)
        return loss

    def _pipeline_eval(self, batch: Any, name: str) -> Tensor:
        module = self.lightning_module
        inputs, targets = split_batch(module, batch)
        with self.precision_plugin.val_step_context(), self._loss_context():
            loss, _ = self._pipeline.eval_step(inputs, targets)
        module.log(name, loss, prog_bar=name == "val_loss", sync_dist=True)
        return loss

    @_names_timeouts("validation_step (pipelined or sharded forward)")
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._loss_context():
                return self._plain_loss(super().validation_step(*args, **kwargs))
        return self._pipeline_eval(args[0], "val_loss")

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._loss_context():
                return self._plain_loss(super().test_step(*args, **kwargs))
        return self._pipeline_eval(args[0], "test_loss")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        batch = args[0]
        inputs = split_batch(self.lightning_module, batch)[0] if isinstance(batch, (tuple, list)) else batch
        with self.precision_plugin.predict_step_context():
            _, outputs = self._pipeline.eval_step(inputs, None)
        return self._pipeline.broadcast_outputs(outputs)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            with self._loss_context():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward for every micro-batch; keep Lightning's hooks.
        module = self.lightning_module
        self.pre_backward(closure_loss)
        self._restore_gradients()
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _park_gradients(self) -> None:
        """Hide the gradients the schedule just computed from Lightning's ``zero_grad``.

        Note:
            Lightning's closure runs ``training_step``, then ``zero_grad`` (on the first batch
            of an accumulation window), then ``backward``. A pipeline schedule runs forward
            *and* backward inside ``training_step``, so its gradients would be wiped. They are
            parked here (references, no copies) and handed back in :meth:`backward`, which
            leaves accumulation exact: a later batch's schedule adds to the parked sum.
        """
        self._parked = []
        for param in self.lightning_module.parameters():
            if param.grad is not None:
                self._parked.append((param, param.grad))
                param.grad = None

    def _restore_gradients(self) -> None:
        for param, grad in getattr(self, "_parked", []):
            param.grad = grad if param.grad is None else param.grad + grad
        self._parked = []

    @_names_timeouts("optimizer_step (data-parallel gradient all-reduce, global-norm clipping, non-finite check)")
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            result = closure()
            # Once per optimizer step, after the last accumulated backward and before
            # Lightning's clipping hook: replicas must agree before the norm is taken.
            if self.zero_stage == 0 and self.layout.data_parallel_enabled:
                gradients.all_reduce_gradients(
                    self.lightning_module.parameters(), self.device_mesh[DATA_PARALLEL].get_group()
                )
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def _install_gradient_clipping(self) -> None:
        """Make Lightning's ``gradient_clip_val`` clip with the global norm.

        Note:
            Lightning clips through ``precision_plugin.clip_grad_by_norm``, which calls torch's
            ``clip_grad_norm_`` on this rank's parameters: the wrong norm under pipelining,
            and an error for a mix of DTensor and plain parameters. The plugin's two clipping
            methods are the documented override points; they are replaced on this strategy's
            plugin instance so any precision (32, bf16-mixed, ...) keeps its other behaviour.
        """
        plugin = self.precision_plugin
        group = self.device_mesh[PIPELINE_PARALLEL].get_group() if self.layout.pipeline_parallel_enabled else None

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: Union[int, float], norm_type: float = 2.0) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            gradients.clip_grad_norm_(params, clip_val, norm_type, pipeline_group=group)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: Union[int, float]) -> None:
            from torch.distributed.tensor import DTensor

            for g in optimizer.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clamp_(-clip_val, clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm
        plugin.clip_grad_by_value = clip_grad_by_value

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from lightning_parallel.parallel.checkpoint import optimizer_state_dict

        return optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a sharded DCP folder that appears under ``filepath`` only when every rank has finished."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options (it writes with DCP).")
        from pathlib import Path

        from lightning_parallel.parallel.checkpoint import save_sharded_checkpoint

        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        checkpoint["lightning_parallel"] = {"layout": self.layout.shape, "zero_stage": self.zero_stage, "schedule": self.schedule}
        save_sharded_checkpoint(path, state, checkpoint, self.global_rank == 0, self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        from pathlib import Path

        from lightning_parallel.parallel.checkpoint import (
            is_sharded_checkpoint,
            load_sharded_checkpoint,
            resolve_checkpoint,
        )

        path = resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist: check ckpt_path (ModelCheckpoint names files by its filename=).")
        if not is_sharded_checkpoint(path):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return load_sharded_checkpoint(
            path, self.model, optimizers, strict=self.lightning_module.strict_loading, weights_only=weights_only
        )

    @property
    def pipeline_runner(self) -> Any:
        """The :class:`~lightning_parallel.parallel.pipeline.PipelineRunner` (None without pipelining)."""
        return self._pipeline

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="data x pipeline x tensor parallelism (lightning_parallel)"
            )
