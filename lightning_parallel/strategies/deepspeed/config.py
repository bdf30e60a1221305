"""The DeepSpeed config of a ZeRO run, built from its three sources (no Lightning inside).

:class:`lightning_parallel.strategies.deepspeed.strategy.DeepSpeedDataParallelStrategy` calls these
functions; they take plain values, so the rules are unit-tested without a Trainer.

Sources, in a fixed order of authority:

1. the Trainer (and, through it, the Hydra config): micro-batch size, gradient
   accumulation, gradient clipping, precision (:func:`apply_trainer_settings`,
   :func:`apply_precision`);
2. the strategy's explicit arguments: ``zero_stage``, ``offload_optimizer``,
   ``offload_parameters`` (:func:`build_zero_config`);
3. an optional raw DeepSpeed config (dict or JSON path) for everything else
   (:func:`load_raw_config`).

A raw config may repeat a value from 1. or 2. but not contradict it: a contradiction is a
``ValueError`` that names both values and where to change them.

Note:
    DeepSpeed defaults ``gradient_clipping`` to 1.0 when a config leaves it out. A run
    whose Trainer does not clip must therefore write 0 explicitly, or its losses drift
    from DDP's (0.11 after a few steps was seen on the test model).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

RawConfig = Union[None, str, os.PathLike, Mapping[str, Any]]

ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_ZERO_STAGE = 2
# Lowest ZeRO stage for each kind of offload (DeepSpeed's documented support).
OFFLOAD_MIN_STAGE = {"offload_optimizer": 1, "offload_param": 3}
# The strategy argument that asks for each kind of offload, and what it keeps in CPU memory.
OFFLOAD_FLAGS = {
    "offload_optimizer": ("offload_optimizer", "optimizer state"),
    "offload_param": ("offload_parameters", "parameters"),
}
# Precision flags DeepSpeed runs on each device type.
CPU_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")
CUDA_PRECISIONS = ("32-true", "32", "16-mixed", "16-true", "bf16-mixed", "bf16-true")


def load_raw_config(config: RawConfig) -> dict[str, Any]:
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
            raise ValueError(
                f"DeepSpeed config file {str(path)!r} does not exist: pass an existing JSON file or a dict."
            )
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


def chosen_zero_stage(zero_stage: Optional[int], stage: Optional[int] = None) -> int:
    """The ZeRO stage from ``zero_stage`` and its deprecated former name ``stage`` (a ``FutureWarning``).

    Args:
        zero_stage: the stage asked for; None: ``stage``, else :data:`DEFAULT_ZERO_STAGE`.
        stage: the deprecated name (``DeepSpeedDataParallelStrategy(stage=...)``, ``strategy.stage=...``).

    Raises:
        ValueError: both given, with different values.
    """
    if stage is None:
        return DEFAULT_ZERO_STAGE if zero_stage is None else zero_stage
    warnings.warn(f"DeepSpeedDataParallelStrategy(stage={stage!r}) is deprecated: use zero_stage={stage!r} (the name "
                  "HybridParallelStrategy uses too; in a config, strategy.zero_stage).", FutureWarning, stacklevel=3)
    if zero_stage is not None and zero_stage != stage:
        raise ValueError(f"DeepSpeedDataParallelStrategy got zero_stage={zero_stage!r} and its deprecated name "
                         f"stage={stage!r}: pass zero_stage only.")
    return stage


def _zero_section(merged: dict[str, Any], stage: int) -> dict[str, Any]:
    """The config's ``zero_optimization`` block (created if missing), with ``stage`` set.

    Raises:
        ValueError: the block is not an object, or states another stage.
    """
    zero = merged.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError("The raw config's 'zero_optimization' must be an object: fix the DeepSpeed config.")
    if "stage" in zero and zero["stage"] != stage:
        raise ValueError(
            f"The raw DeepSpeed config sets zero_optimization.stage={zero['stage']!r} but the strategy has "
            f"zero_stage={stage}: the strategy argument is the one place for the stage -- pass "
            f"zero_stage={zero['stage']!r} (strategy.zero_stage) and drop zero_optimization.stage from the config."
        )
    zero["stage"] = stage
    return zero


def _apply_offload_arguments(zero: dict[str, Any], asked: dict[str, bool]) -> None:
    """Turn the offloads the strategy asks for (``{config key: asked}``) on in ``zero``.

    Raises:
        ValueError: the raw config has an offload block for an asked key that does not offload.
    """
    for key, wanted in asked.items():
        if not wanted:
            continue
        flag = OFFLOAD_FLAGS[key][0]
        block = zero.get(key)
        if block is not None and not _offload_enabled(block):
            raise ValueError(
                f"{flag}=True but the raw DeepSpeed config sets zero_optimization.{key}={block!r}, which does not "
                f"offload: drop zero_optimization.{key} from the config or pass {flag}=False."
            )
        # Keep the raw block's details (nvme_path, pin_memory, ...) when it has one.
        zero[key] = block if block is not None else {"device": "cpu", "pin_memory": False}


def _check_offload_stage(zero: dict[str, Any], stage: int) -> None:
    """Refuse an offload (asked for or from the raw config) that ``stage`` cannot do."""
    for key, min_stage in OFFLOAD_MIN_STAGE.items():
        if _offload_enabled(zero.get(key)) and stage < min_stage:
            flag, what = OFFLOAD_FLAGS[key]
            raise ValueError(
                f"ZeRO stage {stage} cannot offload {what} ({flag} / zero_optimization.{key}): use "
                f"zero_stage>={min_stage} (e.g. strategy=deepspeed_zero3_offload) or turn the offload off."
            )


def build_zero_config(
    zero_stage: int, offload_optimizer: bool = False, offload_parameters: bool = False, config: RawConfig = None
) -> dict[str, Any]:
    """Merge a raw DeepSpeed config under the strategy's explicit ZeRO arguments.

    The explicit arguments decide the ZeRO stage and whether to offload; the raw config
    supplies everything else (bucket sizes, offload details such as ``pin_memory`` or
    an NVMe path, ...). ``offload_*=False`` means "not asked": a raw config may still
    offload, as long as the stage supports it.

    Args:
        zero_stage: ZeRO stage, 0 to 3.
        offload_optimizer: keep optimizer state in CPU memory (stages 1-3).
        offload_parameters: keep parameters in CPU memory (stage 3).
        config: raw DeepSpeed config (dict or JSON path), merged under the arguments.

    Returns:
        A new config dict (the inputs are not modified).

    Raises:
        ValueError: unknown stage, offload the stage cannot do, or a raw value that
            contradicts an explicit argument. The message says what to change.
    """
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero_stage!r} is not a ZeRO stage: use 0, 1, 2 or 3 (strategy.zero_stage=2).")
    merged = load_raw_config(config)
    zero = _zero_section(merged, zero_stage)
    _apply_offload_arguments(zero, {"offload_optimizer": offload_optimizer, "offload_param": offload_parameters})
    _check_offload_stage(zero, zero_stage)
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
    _check_same(
        config, "gradient_accumulation_steps", int(accumulate_grad_batches), "Trainer(accumulate_grad_batches=...)"
    )
    # 0 when the Trainer does not clip: DeepSpeed would otherwise clip at its default 1.0.
    _check_same(config, "gradient_clipping", float(gradient_clip_val or 0.0), "Trainer(gradient_clip_val=...)")
    global_batch = int(micro_batch_size) * int(accumulate_grad_batches) * int(data_parallel_size)
    _check_same(config, "train_batch_size", global_batch, "batch_size x accumulate_grad_batches x ranks")
    return config


def apply_precision(config: dict[str, Any], precision: str, device_type: str) -> dict[str, Any]:
    """Turn ``Trainer(precision=...)`` into DeepSpeed's precision blocks, in place.

    * ``bf16-mixed`` -- DeepSpeed's ``torch_autocast``: parameters, gradients and optimizer
      state stay fp32, matmuls run in bf16, as Lightning's ``bf16-mixed`` does elsewhere;
      ``lower_precision_safe_modules: []`` keeps every gradient reduction fp32 (DeepSpeed's
      default would reduce Linear gradients in bf16).
    * ``bf16-true`` -- DeepSpeed's ``bf16``: bf16 parameters and compute, fp32 master weights
      and optimizer state in DeepSpeed's optimizer; ``communication_data_type: "fp32"``.
    * ``16-mixed``/``16-true`` -- DeepSpeed's ``fp16`` with its loss scaling (CUDA only).

    Args:
        config: the merged DeepSpeed config (modified and returned).
        precision: Lightning's precision flag (``"32-true"``, ``"bf16-mixed"``, ...).
        device_type: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: a precision the device cannot run here (CPU has no fp16), or a raw
            ``fp16``/``bf16``/``torch_autocast`` block that contradicts the Trainer's precision.
    """
    allowed = CPU_PRECISIONS if device_type == "cpu" else CUDA_PRECISIONS
    if precision not in allowed:
        raise ValueError(
            f"precision={precision!r} is not supported by DeepSpeed on {device_type.upper()} here: "
            f"use one of {', '.join(allowed)}"
            + (" (or run on CUDA for 16-mixed / 16-true)." if device_type == "cpu" else ".")
        )
    wanted = {"fp16": precision in ("16-mixed", "16-true"), "bf16": precision == "bf16-true",
              "torch_autocast": precision == "bf16-mixed"}
    for key, enabled in wanted.items():
        _apply_block(config, key, enabled, precision)
    if wanted["torch_autocast"]:
        _check_same(config["torch_autocast"], "dtype", "bfloat16", "Trainer(precision='bf16-mixed')")
        _check_same(
            config["torch_autocast"], "lower_precision_safe_modules", [], "the suite (fp32 gradient reductions)"
        )
    if wanted["bf16"]:
        _check_same(config, "communication_data_type", "fp32", "the suite (fp32 gradient reductions)")
    return config


def _apply_block(config: dict[str, Any], key: str, enabled: bool, precision: str) -> None:
    """Turn precision block ``key`` on when ``enabled``; refuse a raw block that says otherwise."""
    block = config.get(key)
    if block is None:
        if enabled:
            config[key] = {"enabled": True}
        return
    if not isinstance(block, Mapping) or bool(block.get("enabled", False)) != enabled:
        raise ValueError(
            f"The raw DeepSpeed config sets {key}={block!r} but Trainer(precision={precision!r}) "
            f"{'needs' if enabled else 'excludes'} it (bf16-mixed is torch_autocast with fp32 weights, bf16-true is "
            f"DeepSpeed's bf16 with fp32 masters): set the precision with Trainer(precision=...) only and "
            f"drop {key}.enabled from the DeepSpeed config (keep loss-scale options there if you need them)."
        )
