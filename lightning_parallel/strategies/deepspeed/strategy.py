"""DeepSpeed ZeRO data parallelism on CPU (gloo) and CUDA (NCCL), as a Lightning strategy.

:class:`DeepSpeedDataParallelStrategy` subclasses Lightning's ``DeepSpeedStrategy`` and
changes only what ties it to CUDA: the accelerator check, the device-index check, the
DeepSpeed accelerator and process-group backend, and precision. Everything else --
engine set-up, sharded checkpoints, optimizer hand-over -- is Lightning's.

The DeepSpeed config is built in :mod:`lightning_parallel.strategies.deepspeed.config`, from
three sources in a fixed order of authority: the Trainer (micro-batch size, accumulation,
clipping, precision), the strategy's explicit arguments (``zero_stage``, ``offload_*``), then an
optional raw DeepSpeed config for everything else. A raw config may repeat a value of the
first two but not contradict it. Lightning's private hooks and helpers are reached through
:mod:`lightning_parallel._compat`.

How a step enters the engine (one redirected step is one ZeRO-3 step; ``bf16-mixed`` batches left to autocast) is
:mod:`lightning_parallel.strategies.deepspeed.steps`.
"""

from __future__ import annotations

import argparse
import copy
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel._compat import (
    auto_select_batch_size,
    init_deepspeed_distributed,
    remove_module_hooks,
    set_forward_redirection,
    skip_inference_shm_comm,
)
from lightning_parallel.checkpoints.deepspeed.folder import check_deepspeed_checkpoint
from lightning_parallel.checkpoints.detect import describe_checkpoint, unreadable_checkpoint_error
from lightning_parallel.parallel import activation_checkpoint as ac
from lightning_parallel.parallel.compose import check_activation_checkpointing, checkpoint_activations
from lightning_parallel.parallel.options import DEFAULT_TIMEOUT, as_timeout, plain
from lightning_parallel.strategies.deepspeed.config import (
    RawConfig,
    apply_precision,
    apply_trainer_settings,
    build_zero_config,
    chosen_zero_stage,
)
from lightning_parallel.strategies.deepspeed.construction import use_deepspeed_accelerator
from lightning_parallel.strategies.deepspeed.steps import AutocastDeepSpeedPrecision, ZeRO3ForwardRedirection
from lightning_parallel.strategies.module_adapter import strategy_adapter
from lightning_parallel.strategies.reduction import ReduceWithoutBarrier

# Names registered by DeepSpeedDataParallelStrategy.register_strategies -> constructor arguments.
REGISTERED = {
    "deepspeed_zero1": ("DeepSpeed ZeRO stage 1 (optimizer state sharded), CPU or CUDA", {"zero_stage": 1}),
    "deepspeed_zero2": ("DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded), CPU or CUDA",
                        {"zero_stage": 2}),
    "deepspeed_zero3": ("DeepSpeed ZeRO stage 3 (optimizer state, gradients and parameters sharded)",
                        {"zero_stage": 3}),
    "deepspeed_zero3_offload": ("DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to CPU memory",
                                {"zero_stage": 3, "offload_optimizer": True, "offload_parameters": True}),
}


class DeepSpeedDataParallelStrategy(ReduceWithoutBarrier, DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism that runs on CPU (gloo) as well as CUDA (NCCL).

    Lightning's ``DeepSpeedStrategy`` with the CUDA-only restriction lifted. The batch
    size, gradient accumulation, clipping and precision come from the Trainer and its data;
    this strategy only asks for what is DeepSpeed's own. Under ZeRO-3 a model built in
    ``configure_model`` is partitioned as it is constructed (``deepspeed.zero.Init``, Lightning's
    ``model_sharded_context``), on CPU too: no rank holds it whole (see
    :mod:`~lightning_parallel.strategies.deepspeed.construction`).

    Args:
        zero_stage: ZeRO stage: 0 (plain data parallel), 1 (shard optimizer state),
            2 (+ gradients; the default) or 3 (+ parameters); the hybrid strategy's name for it too.
        offload_optimizer: keep optimizer state in CPU memory (stages 1-3).
        offload_parameters: keep parameters in CPU memory (stage 3 only).
        config: a raw DeepSpeed config (dict or JSON path) merged under the arguments
            above; it may not contradict them or the Trainer (see module docstring).
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        precision_plugin: set by the Trainer (a ``DeepSpeedPrecision``).
        process_group_backend: ``"gloo"``/``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout: collective timeout (``timedelta`` or seconds), so a dead rank fails the run
            instead of hanging it; default :data:`~lightning_parallel.parallel.options.DEFAULT_TIMEOUT`.
        logging_level: DeepSpeed's log level.
        load_full_weights: ``ckpt_path`` is a single-file Lightning checkpoint (from DDP,
            say) rather than a DeepSpeed checkpoint folder; weights only, no optimizer state.
        activation_checkpointing: ``"none"``, ``"full"``, ``"selective"`` (not with stage 3) or a list
            of submodule globs (see :mod:`lightning_parallel.parallel.activation_checkpoint`).
        stage: deprecated name of ``zero_stage`` (a ``FutureWarning``; both only if equal).

    Raises:
        ValueError: unknown stage, an offload the stage does not support, a raw config
            that contradicts the arguments, all at construction; a raw config that
            contradicts the Trainer, or a precision the device cannot run, before training.
    """

    strategy_name = "deepspeed_zero"
    stage = property(lambda self: self.zero_stage, doc="Deprecated name of ``zero_stage`` (read-only).")

    def __init__(
        self,
        zero_stage: Optional[int] = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: RawConfig = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[timedelta, int, float, None] = DEFAULT_TIMEOUT,
        logging_level: int = logging.WARN, load_full_weights: bool = False,
        activation_checkpointing: Union[str, list[str]] = "none", stage: Optional[int] = None,
    ) -> None:
        stage = chosen_zero_stage(zero_stage, stage)  # zero_stage, or its deprecated name
        self.activation_checkpointing = ac.check_deepspeed_stage(
            ac.check_choice(plain(activation_checkpointing)), stage
        )
        merged = build_zero_config(stage, offload_optimizer, offload_parameters, config)
        timeout = as_timeout(timeout)
        super().__init__(accelerator=accelerator, config=merged, logging_level=logging_level,
                         parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, load_full_weights=load_full_weights)
        self.zero_stage = stage
        self.timeout = timeout
        # ZeRO-3 only changes behaviour (see ZeRO3ForwardRedirection); other stages pass through.
        set_forward_redirection(self, ZeRO3ForwardRedirection())
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``deepspeed_zero1/2/3`` and ``deepspeed_zero3_offload``; calling it twice is harmless.

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        for name, (description, init_params) in REGISTERED.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **init_params)

    @property
    def device_type(self) -> str:
        """``"cuda"`` on a CUDA accelerator, else ``"cpu"`` (what DeepSpeed's accelerator and backend follow)."""
        return "cuda" if isinstance(self.accelerator, CUDAAccelerator) else "cpu"

    @override
    def setup_environment(self) -> None:
        """Check the accelerator and precision, point DeepSpeed at the same device type, start the group."""
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(
                f"{type(self).__name__} runs on CPU or CUDA, not {type(self.accelerator).__name__}: "
                "use Trainer(accelerator='cpu') or Trainer(accelerator='cuda')."
            )
        apply_precision(copy.deepcopy(self.config), self.precision_plugin.precision, self.device_type)
        if self.precision_plugin.precision == "bf16-mixed" and type(self.precision_plugin) is DeepSpeedPrecision:
            self.precision_plugin = AutocastDeepSpeedPrecision("bf16-mixed")
        if self.world_size > 1:  # every DeepSpeed rank is a data-parallel replica
            strategy_adapter(self).check_batch_split([f"data parallel over {self.world_size} ranks"])
        check_activation_checkpointing(
            self.lightning_module, self.activation_checkpointing, adapter=strategy_adapter(self)
        )
        use_deepspeed_accelerator(self.device_type)  # before configure_model: zero.Init allocates there
        if self.device_type == "cpu":
            skip_inference_shm_comm()  # an inference-only op DeepSpeed would compile (24 s) when its comm starts
        # Skip DeepSpeedStrategy.setup_environment (its CUDA check); DDPStrategy's sets the
        # device up and calls setup_distributed below.
        super(DeepSpeedStrategy, self).setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        """Lightning's, layers checkpointed first (torch's checkpointing: DeepSpeed's needs Megatron's mpu)."""
        adapter = strategy_adapter(self, refresh=True)  # configure_model has run: resolve what it built
        if self.world_size > 1:  # again: configure_model may have built the model only now
            adapter.check_batch_split([f"data parallel over {self.world_size} ranks"])
        if not any(ac.is_checkpointed(m) for m in self.lightning_module.modules()):
            checkpoint_activations(self.lightning_module, self.activation_checkpointing, adapter=adapter)
        super().setup(trainer)

    @override
    def setup_distributed(self) -> None:
        """Join the process group through DeepSpeed (gloo on CPU, nccl on CUDA)."""
        if self.device_type == "cuda":
            super().setup_distributed()
            return
        # CPU devices have no index, so Lightning's device-index check does not apply.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        init_deepspeed_distributed(self)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's step; a Hugging Face causal LM's loss is the token mean over all ranks' batches.

        The adapter's ``loss_weighting`` (see :mod:`lightning_parallel.adapters.hf.loss`): without it each
        rank would average its own valid tokens, which is not the single-process loss when padding differs by rank.
        """
        module = self.lightning_module
        weighting = strategy_adapter(self).loss_weighting(
            None, self.world_size, module.trainer.accumulate_grad_batches, warn=self.global_rank == 0
        )
        if weighting is None:
            return super().training_step(*args, **kwargs)
        with weighting.training():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Back-propagate through the DeepSpeed engine without dividing by the accumulation steps again.

        Note:
            Lightning already divides the loss by ``accumulate_grad_batches`` before
            ``backward``; DeepSpeed's ``engine.backward`` divides by
            ``gradient_accumulation_steps`` once more by default, which shrinks every
            accumulated gradient by that factor (a 0.08 loss gap to one process after 10
            steps with accumulation 2). ``scale_wrt_gas=False`` keeps a single division.
        """
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _engine_args(self) -> argparse.Namespace:
        # DeepSpeed reads the device from ``device_rank``; a CPU device has no index, so
        # Lightning's ``root_device.index`` (None) would break it. The local rank is what
        # DeepSpeed itself uses when launched by its own runner.
        index = self.root_device.index if self.device_type == "cuda" else self.local_rank
        return argparse.Namespace(device_rank=index)

    @override
    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[Any, Optimizer]:
        """``deepspeed.initialize`` as Lightning calls it, with a device rank that also works on CPU."""
        import deepspeed

        from lightning_parallel._compat.c10d_internals import default_group_timeout

        # DeepSpeed's groups (ZeRO's clone of the world group among them) are new_group(ranks) without a timeout: a
        # rank hung in backward held the others 30 minutes, not `timeout` (the fault matrix).
        with default_group_timeout(self.timeout):
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                args=self._engine_args(), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False,
            )
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        # Lightning's version, with the CPU-safe device rank: an engine without optimizer
        # for validate/test/predict, keeping the training config's precision and ZeRO-3.
        import deepspeed

        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16", "torch_autocast"):  # torch_autocast: bf16-mixed (apply_precision)
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=self._engine_args(), config=inference_config, model=model, optimizer=None, lr_scheduler=None,
            model_parameters=[], dist_init_required=False,
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Lightning's DeepSpeed folder, plus the ``hugging_face`` entry ``lp-convert --to hf``
        builds the model from."""
        checkpoint.update(strategy_adapter(self).checkpoint_metadata())
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """DeepSpeed's own folders (and, with ``load_full_weights`` under ZeRO-3, one file);
        anything else refused with the fix."""
        path = Path(self.broadcast(str(checkpoint_path)))
        writer, description = describe_checkpoint(path)
        if writer == "deepspeed":  # DeepSpeed's engine unpickles every file with weights_only=False: vouch first
            check_deepspeed_checkpoint(path, weights_only)
            return super().load_checkpoint(checkpoint_path, weights_only)
        if writer == "lightning-single-file" and self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)
        if writer == "unknown":
            raise unreadable_checkpoint_error(path, reader=type(self).__name__)
        raise ValueError(
            f"{type(self).__name__} resumes DeepSpeed checkpoint folders; {str(path)!r} is {description}. To continue "
            "that run with its optimizer state, resume it under HybridParallelStrategy(zero_stage=2 or 3) (the same "
            "sharding of the data axis, the losses of the uninterrupted run). For its weights only under DeepSpeed, "
            "pass DeepSpeedDataParallelStrategy(zero_stage=3, load_full_weights=True) and a single-file checkpoint "
            "(lp-convert SRC OUT.ckpt --to lightning turns a folder into one)."
        )

    @override
    def _format_config(self) -> None:
        # Replaces Lightning's version, which refuses gradient_accumulation_steps in any raw
        # config and lets a raw gradient_clipping silently beat the Trainer's.
        if self.lightning_module is None:
            return
        trainer = self.lightning_module.trainer
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "DeepSpeed clips gradients by norm only: use Trainer(gradient_clip_algorithm='norm') "
                "or gradient_clip_val=None."
            )
        apply_trainer_settings(
            self.config,
            micro_batch_size=auto_select_batch_size(self),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            data_parallel_size=self.world_size,
        )
        apply_precision(self.config, self.precision_plugin.precision, self.device_type)
        rank_zero_info(
            f"DeepSpeed ZeRO-{self.zero_stage} on {self.device_type}: micro-batch "
            f"{self.config['train_micro_batch_size_per_gpu']} x accumulation "
            f"{self.config['gradient_accumulation_steps']} x {self.world_size} ranks = "
            f"{self.config['train_batch_size']} samples per step, clipping {self.config['gradient_clipping']}"
        )
