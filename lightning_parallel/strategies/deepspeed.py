"""DeepSpeed ZeRO data parallelism on CPU (gloo) and CUDA (NCCL), as a Lightning strategy.

:class:`DeepSpeedDataParallelStrategy` subclasses Lightning's ``DeepSpeedStrategy`` and
changes only what ties it to CUDA: the accelerator check, the device-index check, the
DeepSpeed accelerator and process-group backend, and precision. Everything else --
engine set-up, sharded checkpoints, optimizer hand-over -- is Lightning's.

The DeepSpeed config is built in one place, from three sources in a fixed order of
authority:

1. the Trainer (and, through it, the Hydra config): micro-batch size, gradient
   accumulation, gradient clipping, precision;
2. the strategy's explicit arguments: ``stage``, ``offload_optimizer``, ``offload_parameters``;
3. an optional raw DeepSpeed config (dict or JSON path) for everything else.

A raw config may repeat a value from 1. or 2. but not contradict it: a contradiction is a
``ValueError`` that names both values and where to change them.

Note:
    DeepSpeed defaults ``gradient_clipping`` to 1.0 when a config leaves it out. A run
    whose Trainer does not clip must therefore write 0 explicitly, or its losses drift
    from DDP's (0.11 after a few steps was seen on the test model).

Note:
    Under ZeRO-3, Lightning's step redirection enters the LightningModule twice per step:
    the engine calls it with ``forward`` patched to ``training_step``, and
    ``training_step`` calls ``self(...)``. DeepSpeed starts a new step (``reset_step``)
    at every entry of its top module, so its parameter trace was cut after one module and
    discarded every step: parameters were gathered again for backward (2x the all-gather
    bytes) and the trace checks cost 8 broadcasts per step.
    :class:`_ZeRO3ForwardRedirection` makes one redirected step one DeepSpeed step; the
    collectives then equal those of a raw ``deepspeed.initialize`` loop.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer

ZERO_STAGES = (0, 1, 2, 3)
# Lowest ZeRO stage for each kind of offload (DeepSpeed's documented support).
OFFLOAD_MIN_STAGE = {"offload_optimizer": 1, "offload_param": 3}
# Precision flags DeepSpeed runs on each device type.
_CPU_PRECISIONS = ("32-true", "32")
_CUDA_PRECISIONS = ("32-true", "32", "16-mixed", "16-true", "bf16-mixed", "bf16-true")

# Names registered by DeepSpeedDataParallelStrategy.register_strategies -> constructor arguments.
REGISTERED = {
    "deepspeed_zero1": ("DeepSpeed ZeRO stage 1 (optimizer state sharded), CPU or CUDA", {"stage": 1}),
    "deepspeed_zero2": ("DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded), CPU or CUDA", {"stage": 2}),
    "deepspeed_zero3": ("DeepSpeed ZeRO stage 3 (optimizer state, gradients and parameters sharded)", {"stage": 3}),
    "deepspeed_zero3_offload": (
        "DeepSpeed ZeRO stage 3 with optimizer state and parameters offloaded to CPU memory",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
}


def load_raw_config(config: Union[None, str, os.PathLike, Mapping[str, Any]]) -> dict[str, Any]:
    """Read a raw DeepSpeed config: a mapping (copied) or the path of a JSON file.

    Args:
        config: ``None`` (empty config), a dict-like, or a path to a JSON file.

    Raises:
        ValueError: the path does not exist, is not JSON, or does not hold an object.
    """
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ValueError(f"DeepSpeed config file {str(path)!r} does not exist: pass an existing JSON file or a dict.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"DeepSpeed config file {str(path)!r} is not valid JSON ({err}): fix the file.") from None
        config = loaded
    if not isinstance(config, Mapping):
        raise ValueError(f"A DeepSpeed config must be a JSON object (dict), got {type(config).__name__}.")
    # Hydra hands over DictConfig; a plain deep copy keeps the caller's object untouched.
    return json.loads(json.dumps(_to_plain(config)))


def _to_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_to_plain(v) for v in value]
    return value


def _offload_enabled(block: Any) -> bool:
    """Whether a raw ``offload_optimizer``/``offload_param`` block actually offloads."""
    return isinstance(block, Mapping) and str(block.get("device", "none")).lower() not in ("none", "")


def build_zero_config(
    stage: int,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    config: Union[None, str, os.PathLike, Mapping[str, Any]] = None,
) -> dict[str, Any]:
    """Merge a raw DeepSpeed config under the strategy's explicit ZeRO arguments.

    The explicit arguments decide the ZeRO stage and whether to offload; the raw config
    supplies everything else (bucket sizes, offload details such as ``pin_memory`` or
    an NVMe path, ...). ``offload_*=False`` means "not asked": a raw config may still
    offload, as long as the stage supports it.

    Args:
        stage: ZeRO stage, 0 to 3.
        offload_optimizer: keep optimizer state in CPU memory (stages 1-3).
        offload_parameters: keep parameters in CPU memory (stage 3).
        config: raw DeepSpeed config (dict or JSON path), merged under the arguments.

    Returns:
        A new config dict (the inputs are not modified).

    Raises:
        ValueError: unknown stage, offload the stage cannot do, or a raw value that
            contradicts an explicit argument. The message says what to change.
    """
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage: use 0, 1, 2 or 3 (e.g. strategy=deepspeed_zero2).")
    merged = load_raw_config(config)
    zero = merged.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError("The raw config's 'zero_optimization' must be an object: fix the DeepSpeed config.")
    if "stage" in zero and zero["stage"] != stage:
        raise ValueError(
            f"The raw DeepSpeed config sets zero_optimization.stage={zero['stage']!r} but the strategy has "
            f"stage={stage}: the strategy argument is the one place for the stage -- pass stage={zero['stage']!r} "
            "(or pick strategy=deepspeed_zero<N>) and drop zero_optimization.stage from the config."
        )
    zero["stage"] = stage
    for flag, key, asked in (
        ("offload_optimizer", "offload_optimizer", offload_optimizer),
        ("offload_parameters", "offload_param", offload_parameters),
    ):
        if not asked:
            continue
        block = zero.get(key)
        if block is not None and not _offload_enabled(block):
            raise ValueError(
                f"{flag}=True but the raw DeepSpeed config sets zero_optimization.{key}={block!r}, which does not "
                f"offload: drop zero_optimization.{key} from the config or pass {flag}=False."
            )
        # Keep the raw block's details (nvme_path, pin_memory, ...) when it has one.
        zero[key] = block if block is not None else {"device": "cpu", "pin_memory": False}
    for key, min_stage in OFFLOAD_MIN_STAGE.items():
        if _offload_enabled(zero.get(key)) and stage < min_stage:
            flag = "offload_parameters" if key == "offload_param" else "offload_optimizer"
            raise ValueError(
                f"ZeRO stage {stage} cannot offload {'parameters' if key == 'offload_param' else 'optimizer state'} "
                f"({flag} / zero_optimization.{key}): use stage>={min_stage} (e.g. strategy=deepspeed_zero3_offload) "
                f"or turn the offload off."
            )
    # A torch optimizer (from configure_optimizers) is what this suite hands over; DeepSpeed
    # would refuse it under ZeRO or offload unless told that is intended.
    merged.setdefault("zero_allow_untested_optimizer", True)
    if _offload_enabled(zero.get("offload_optimizer")):
        merged.setdefault("zero_force_ds_cpu_optimizer", False)
    return merged


def _check_same(config: dict[str, Any], key: str, value: Any, source: str) -> None:
    if key in config and config[key] != value:
        raise ValueError(
            f"The raw DeepSpeed config sets {key}={config[key]!r} but {source} gives {value!r}: "
            f"drop {key} from the DeepSpeed config and set it through {source} only."
        )
    config[key] = value


def apply_trainer_settings(
    config: dict[str, Any],
    micro_batch_size: int,
    accumulate_grad_batches: int,
    gradient_clip_val: Optional[float],
    data_parallel_size: int,
) -> dict[str, Any]:
    """Fill DeepSpeed's batch, accumulation and clipping keys from the Trainer, in place.

    Args:
        config: the merged DeepSpeed config (modified and returned).
        micro_batch_size: samples per rank per forward pass (the train loader's batch size).
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches=...)``.
        gradient_clip_val: ``Trainer(gradient_clip_val=...)``; ``None`` or 0 means no clipping.
        data_parallel_size: number of ranks (DeepSpeed's ``train_batch_size`` counts them all).

    Raises:
        ValueError: the raw config states one of these with another value.
    """
    _check_same(config, "train_micro_batch_size_per_gpu", int(micro_batch_size), "the train dataloader's batch_size")
    _check_same(config, "gradient_accumulation_steps", int(accumulate_grad_batches), "Trainer(accumulate_grad_batches=...)")
    # 0 when the Trainer does not clip: DeepSpeed would otherwise clip at its default 1.0.
    _check_same(config, "gradient_clipping", float(gradient_clip_val or 0.0), "Trainer(gradient_clip_val=...)")
    global_batch = int(micro_batch_size) * int(accumulate_grad_batches) * int(data_parallel_size)
    _check_same(config, "train_batch_size", global_batch, "batch_size x accumulate_grad_batches x ranks")
    return config


def apply_precision(config: dict[str, Any], precision: str, device_type: str) -> dict[str, Any]:
    """Turn ``Trainer(precision=...)`` into DeepSpeed's ``fp16``/``bf16`` blocks, in place.

    Args:
        config: the merged DeepSpeed config (modified and returned).
        precision: Lightning's precision flag (``"32-true"``, ``"bf16-mixed"``, ...).
        device_type: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: a precision the device cannot run here (CPU runs fp32 only), or a raw
            ``fp16``/``bf16`` block that contradicts the Trainer's precision.
    """
    allowed = _CPU_PRECISIONS if device_type == "cpu" else _CUDA_PRECISIONS
    if precision not in allowed:
        raise ValueError(
            f"precision={precision!r} is not supported by DeepSpeed on {device_type.upper()} here: "
            f"use one of {', '.join(allowed)}"
            + (" (or run on CUDA for bf16-mixed / 16-mixed)." if device_type == "cpu" else ".")
        )
    wanted = {"fp16": precision in ("16-mixed", "16-true"), "bf16": precision in ("bf16-mixed", "bf16-true")}
    for key, enabled in wanted.items():
        block = config.get(key)
        if block is None:
            if enabled:
                config[key] = {"enabled": True}
            continue
        if not isinstance(block, Mapping) or bool(block.get("enabled", False)) != enabled:
            raise ValueError(
                f"The raw DeepSpeed config sets {key}={block!r} but Trainer(precision={precision!r}) "
                f"{'needs' if enabled else 'excludes'} it: set the precision with Trainer(precision=...) only and "
                f"drop {key}.enabled from the DeepSpeed config (keep loss-scale options there if you need them)."
            )
    return config


def _zero3_param_coordinator(engine: Any) -> Any:
    """The ZeRO-3 parameter coordinator of a DeepSpeed engine, or ``None`` (other stages, no engine yet)."""
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    if not callable(partitioned) or not partitioned():
        return None
    optimizer = getattr(engine, "optimizer", None)
    # Training engine: the ZeRO-3 optimizer holds the offload object; an engine without
    # optimizer (validate/test/predict) has the offload object as its optimizer.
    offload = getattr(optimizer, "parameter_offload", optimizer)
    get_coordinator = getattr(offload, "get_param_coordinator", None)
    return get_coordinator() if callable(get_coordinator) else None


class _ZeRO3ForwardRedirection(_DDPForwardRedirection):
    """Lightning's step redirection, counted by ZeRO-3 as one step however often the module is entered.

    Lightning runs ``training_step`` (and the evaluation steps) through the engine by
    patching the LightningModule's ``forward``; the step then calls ``self(...)``, which
    enters the same top module again. DeepSpeed's start-of-forward hook on that module
    calls ``reset_step`` on every entry, so the second entry completes a one-module trace
    that the next submodule invalidates -- every step. While a step is redirected, only the
    first ``reset_step`` runs: the trace then covers the whole forward and backward, is
    recorded once and reused, as in a raw ``engine(batch)`` loop.
    """

    def __call__(self, wrapper_module: Module, original_module: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        coordinator = _zero3_param_coordinator(wrapper_module)
        if coordinator is None or "reset_step" in vars(coordinator):
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        reset_step = coordinator.reset_step
        entries = 0

        def reset_on_first_entry() -> None:
            nonlocal entries
            entries += 1
            if entries == 1:
                reset_step()

        # An instance attribute shadows the method for this call only; deleted below.
        coordinator.reset_step = reset_on_first_entry
        try:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        finally:
            del coordinator.reset_step


class DeepSpeedDataParallelStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism that runs on CPU (gloo) as well as CUDA (NCCL).

    Lightning's ``DeepSpeedStrategy`` with the CUDA-only restriction lifted. The batch
    size, gradient accumulation, clipping and precision come from the Trainer and its data;
    this strategy only asks for what is DeepSpeed's own.

    Args:
        stage: ZeRO stage: 0 (plain data parallel), 1 (shard optimizer state),
            2 (+ gradients) or 3 (+ parameters).
        offload_optimizer: keep optimizer state in CPU memory (stages 1-3).
        offload_parameters: keep parameters in CPU memory (stage 3 only).
        config: a raw DeepSpeed config (dict or JSON path) merged under the arguments
            above; it may not contradict them or the Trainer (see module docstring).
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        precision_plugin: set by the Trainer (a ``DeepSpeedPrecision``).
        process_group_backend: ``"gloo"``/``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout: collective timeout, so a dead rank fails the run instead of hanging it.
        logging_level: DeepSpeed's log level.
        load_full_weights: ``ckpt_path`` is a single-file Lightning checkpoint (from DDP,
            say) rather than a DeepSpeed checkpoint folder; weights only, no optimizer state.

    Raises:
        ValueError: unknown stage, an offload the stage does not support, a raw config
            that contradicts the arguments, all at construction; a raw config that
            contradicts the Trainer, or a precision the device cannot run, before training.
    """

    strategy_name = "deepspeed_zero"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: Union[None, str, os.PathLike, Mapping[str, Any]] = None,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        logging_level: int = logging.WARN,
        load_full_weights: bool = False,
    ) -> None:
        merged = build_zero_config(stage, offload_optimizer, offload_parameters, config)
        super().__init__(
            accelerator=accelerator,
            config=merged,
            logging_level=logging_level,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            load_full_weights=load_full_weights,
        )
        self.stage = stage
        # ZeRO-3 only changes behaviour (see _ZeRO3ForwardRedirection); other stages pass through.
        self._forward_redirection = _ZeRO3ForwardRedirection()
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``deepspeed_zero1/2/3`` and ``deepspeed_zero3_offload``; calling it twice is harmless.

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        for name, (description, init_params) in REGISTERED.items():
            if name in strategy_registry:
                continue
            strategy_registry.register(name, cls, description=description, **init_params)

    @property
    def _device_type(self) -> str:
        return "cuda" if isinstance(self.accelerator, CUDAAccelerator) else "cpu"

    def setup_environment(self) -> None:
        """Check the accelerator and precision, point DeepSpeed at the same device type, start the group."""
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise ValueError(
                f"{type(self).__name__} runs on CPU or CUDA, not {type(self.accelerator).__name__}: "
                "use Trainer(accelerator='cpu') or Trainer(accelerator='cuda')."
            )
        apply_precision(copy.deepcopy(self.config), self.precision_plugin.precision, self._device_type)
        _use_deepspeed_accelerator(self._device_type)
        # Skip DeepSpeedStrategy.setup_environment (its CUDA check); DDPStrategy's sets the
        # device up and calls setup_distributed below.
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        """Join the process group through DeepSpeed (gloo on CPU, nccl on CUDA)."""
        if self._device_type == "cuda":
            super().setup_distributed()
            return
        # CPU devices have no index, so Lightning's device-index check does not apply.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> torch.Tensor:
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
        index = self.root_device.index if self._device_type == "cuda" else self.local_rank
        return argparse.Namespace(device_rank=index)

    def _setup_model_and_optimizer(
        self, model: Module, optimizer: Optional[Optimizer], lr_scheduler: Optional[Any] = None
    ) -> tuple[Any, Optimizer]:
        """``deepspeed.initialize`` as Lightning calls it, with a device rank that also works on CPU."""
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=self._engine_args(),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: Module) -> None:
        # Lightning's version, with the CPU-safe device rank: an engine without optimizer
        # for validate/test/predict, keeping the training config's precision and ZeRO-3.
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        if self.zero_stage_3:
            inference_config["zero_allow_untested_optimizer"] = self.config["zero_allow_untested_optimizer"]
            inference_config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=self._engine_args(),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

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
            micro_batch_size=self._auto_select_batch_size(),
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            data_parallel_size=self.world_size,
        )
        apply_precision(self.config, self.precision_plugin.precision, self._device_type)
        rank_zero_info(
            f"DeepSpeed ZeRO-{self.stage} on {self._device_type}: micro-batch "
            f"{self.config['train_micro_batch_size_per_gpu']} x accumulation {self.config['gradient_accumulation_steps']}"
            f" x {self.world_size} ranks = {self.config['train_batch_size']} samples per step, "
            f"clipping {self.config['gradient_clipping']}"
        )


def _use_deepspeed_accelerator(device_type: str) -> None:
    """Make DeepSpeed's process-wide accelerator match Lightning's device type.

    Note:
        DeepSpeed picks its accelerator once per process (CUDA when it sees a GPU). A CPU
        run on a machine with a GPU must switch it to CPU before the engine is built, or
        DeepSpeed would place tensors on CUDA and talk NCCL. It is DeepSpeed's own global;
        setting it to the device this process trains on is the only safe value.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    current = get_accelerator()
    if device_type == "cpu" and current.device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    elif device_type == "cuda" and current.device_name() != "cuda":
        raise ValueError(
            f"Lightning trains on CUDA but DeepSpeed's accelerator is {current.device_name()!r}: "
            "unset DS_ACCELERATOR (or set DS_ACCELERATOR=cuda)."
        )
