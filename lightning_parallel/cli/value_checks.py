"""Checks of single values before any process starts, each naming the key the user typed.

Before these, a negative ``model.optimizer.lr`` failed in torch's optimizer after the process group started, a
``data.batch_size=0`` as ``micro_batch_size=0`` (exit 1, once per rank), a ``strategy.microbatches`` that does not
divide the batch inside the first pipeline step, and ``strategy.schedule=1f1f`` without a suggestion. Here each is
one :class:`ValueError` that names the setting and its fix; :func:`lightning_parallel.cli.preflight.preflight`
turns it into ``lp-train: error: ...`` and exit code 2.
"""

from __future__ import annotations

import copy
import math
import os
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.suggest import choice_error, closest
from lightning_parallel.layout import ParallelLayout

# Lightning's precision names (lightning.fabric's connector accepts these and their short forms).
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "32", "16", "bf16", "64")


def _strategy_choices() -> dict[str, tuple[str, ...]]:
    """``strategy.<key>``: the names it accepts (a list of cut points or globs is checked by the strategy)."""
    from lightning_parallel.parallel.float8.checks import RECIPES
    from lightning_parallel.parallel.option_checks import CONTEXT_METHODS, DTYPES, OFFLOAD_MODES
    from lightning_parallel.parallel.pipeline.partition import METHODS
    from lightning_parallel.parallel.pipeline.schedules import SCHEDULES

    return {"schedule": tuple(SCHEDULES), "partition": METHODS, "context_parallel_method": CONTEXT_METHODS,
            "offload": OFFLOAD_MODES, "param_dtype": tuple(DTYPES), "reduce_dtype": tuple(DTYPES),
            "activation_checkpointing": ("none", "full", "selective"), "float8": RECIPES}


def check_float8_strategy(cfg: DictConfig) -> None:
    """``strategy.float8`` on a strategy without an FP8 path (DeepSpeed, TorchRec, DDP): refused, naming the fix.

    Args:
        cfg: the composed config.
    """
    strategy = cfg.get("strategy")
    if not OmegaConf.is_dict(strategy) or strategy.get("float8") is None:
        return
    import importlib

    from lightning_parallel.strategies import HybridParallelStrategy

    target = str(strategy.get("_target_", ""))
    module, _, name = target.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return  # a target that does not import: check_targets names it
    if not (isinstance(found, type) and issubclass(found, HybridParallelStrategy)):
        raise ValueError(f"strategy.float8={strategy.float8} trains torchao's FP8 Linear layers under the hybrid "
                         f"strategy and its presets (strategy=hybrid|pipeline|tensor|context); {name} has no FP8 "
                         "path (DeepSpeed's ZeRO and TorchRec keep their own precision). Use strategy=hybrid "
                         "strategy.zero_stage=3 for ZeRO-3 sharding with FP8, or drop strategy.float8.")


def compile_backends() -> list[str]:
    """The ``torch.compile`` backends a user may pick: torch's list without its ``*_TESTING_ONLY`` backends."""
    import torch

    return [b for b in torch.compiler.list_backends(exclude_tags=()) if not b.endswith("_TESTING_ONLY")]


def check_strategy_choices(cfg: DictConfig) -> None:
    """``strategy.schedule``, ``partition``, ``compile`` and the other named choices, with did-you-mean.

    Args:
        cfg: the composed config (a strategy given by name, such as ``ddp``'s string, has none).
    """
    strategy = cfg.get("strategy")
    if not OmegaConf.is_dict(strategy):
        return
    # Only a typo with a close choice is refused here: otherwise the strategy's own message (which says what each
    # choice is for, e.g. ring for any head count) is the better one, raised when preflight builds the strategy.
    for key, choices in _strategy_choices().items():
        value = strategy.get(key)
        if isinstance(value, str) and value not in choices and closest(value, choices):
            raise ValueError(choice_error(f"strategy.{key}", value, choices))
    value = strategy.get("compile")
    if isinstance(value, str) and value.lower() not in ("true", "false"):
        backends = compile_backends()
        if value not in backends and closest(value, backends):
            import torch

            # Shown: torch's own short list (no debug or experimental ones) and the eager ones; matched: all.
            shown = sorted({*torch.compiler.list_backends(), "eager", "aot_eager"})
            message = choice_error("strategy.compile", value, backends)
            raise ValueError(message.split(" Use ")[0] + f" Use true (inductor), false, or a torch.compile backend "
                             f"such as {', '.join(shown)} (torch.compiler.list_backends()).")


def _scaling_key(message: str, cfg: DictConfig) -> str:
    """``micro_batch_size=0`` -> ``data.batch_size=0``: the scaling arithmetic's names as the config's keys."""
    targets = cfg.scaling.get("apply_to") or {}
    for name in ("micro_batch_size", "accumulate_grad_batches"):
        if targets.get(name):
            message = re.sub(rf"(?<![\w.]){name}=", f"{targets[name]}=", message)
    message = message.replace("reference.global_batch_size=", "scaling.reference.global_batch_size=")
    message = re.sub(r"reference global batch (\d+)",
                     r"reference global batch (scaling.reference.global_batch_size=\1)", message)
    if message.endswith("must be a positive integer."):
        message = message[:-1] + ": give 1 or more."
    return message


def check_scaling(cfg: DictConfig, layout: ParallelLayout) -> Any:
    """The batch, accumulation and lr after rescaling (on a copy), with the config's keys in any error.

    Args:
        cfg: the composed config (unchanged).
        layout: the run's layout (its data-parallel size counts).

    Returns:
        The :class:`~lightning_parallel.scaling.EffectiveHparams` the run will use.
    """
    from lightning_parallel.cli.effective import apply_scaling

    try:
        effective = apply_scaling(copy.deepcopy(cfg), layout)
    except ValueError as exc:
        raise ValueError(_scaling_key(str(exc), cfg)) from exc
    lr_key = cfg.scaling.apply_to.lr
    configured = OmegaConf.select(cfg, lr_key)
    if not isinstance(effective.lr, (int, float)) or not math.isfinite(effective.lr) or effective.lr <= 0:
        raise ValueError(f"{lr_key}={configured} is not a positive learning rate (the optimizer would refuse it "
                         f"after every rank started): give a positive value, e.g. {lr_key}=3e-4.")
    return effective


def check_optimizer(cfg: DictConfig) -> None:
    """``model.optimizer.betas`` in [0, 1), ``weight_decay`` and ``eps`` not negative (torch's own rules)."""
    model = cfg.get("model")
    optimizer = model.get("optimizer") if OmegaConf.is_dict(model) else None
    if not OmegaConf.is_dict(optimizer):
        optimizer = {}
    betas = optimizer.get("betas")
    if OmegaConf.is_list(betas) and any(isinstance(b, (int, float)) and not 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"model.optimizer.betas={list(betas)}: each must be in [0, 1), e.g. "
                         "model.optimizer.betas=[0.9,0.95].")
    for key, node in (("model.optimizer.weight_decay", optimizer), ("model.weight_decay", model),
                      ("model.optimizer.eps", optimizer)):
        value = node.get(key.rsplit(".", 1)[1]) if OmegaConf.is_dict(node) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{key}={value} is negative: give 0 or more (e.g. {key}=0.1).")


def check_microbatches(cfg: DictConfig, layout: ParallelLayout, micro_batch_size: int) -> None:
    """Under a pipeline, ``strategy.microbatches`` must divide the per-device batch (checked in every rank's first
    step before, once per rank).

    Args:
        cfg: the composed config.
        layout: the run's layout.
        micro_batch_size: samples per data-parallel rank after rescaling.
    """
    strategy = cfg.get("strategy")
    micro = strategy.get("microbatches") if OmegaConf.is_dict(strategy) else None
    if not layout.pipeline_parallel_enabled or not isinstance(micro, int) or isinstance(micro, bool):
        return
    key = cfg.scaling.apply_to.micro_batch_size
    if micro < 1:
        raise ValueError(f"strategy.microbatches={micro} must be 1 or more (e.g. strategy.microbatches=4).")
    if micro_batch_size % micro:
        divisors = [d for d in range(1, micro_batch_size + 1) if micro_batch_size % d == 0]
        larger = micro_batch_size + micro - micro_batch_size % micro
        raise ValueError(
            f"{key}={micro_batch_size} (samples per device) does not split into strategy.microbatches={micro} equal "
            f"micro-batches: use strategy.microbatches in {divisors}, or {key}={larger} (a multiple of {micro}).")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_trainer_values(cfg: DictConfig) -> None:
    """``trainer.max_steps``, ``val_check_interval``, ``gradient_clip_val`` and ``precision`` (Lightning checks
    some of them only inside every rank, without the key)."""
    trainer = cfg.trainer
    max_steps = trainer.get("max_steps")
    if _whole(max_steps) and max_steps == 0 or _whole(max_steps) and max_steps < -1:
        raise ValueError(f"trainer.max_steps={max_steps} trains nothing: give a positive count (e.g. "
                         "trainer.max_steps=100), or -1 to run by trainer.max_epochs.")
    interval = trainer.get("val_check_interval")
    if _whole(interval) and interval < 1 or isinstance(interval, float) and not 0.0 < interval <= 1.0:
        raise ValueError(f"trainer.val_check_interval={interval}: give a number of batches (1 or more) or a "
                         "fraction of an epoch in (0, 1], e.g. trainer.val_check_interval=100.")
    clip = trainer.get("gradient_clip_val")
    if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip < 0:
        raise ValueError(f"trainer.gradient_clip_val={clip} is negative: give 0 or null (no clipping) or a "
                         "positive norm, e.g. trainer.gradient_clip_val=1.0.")
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise ValueError(choice_error("trainer.precision", precision, PRECISIONS[:6]))


def check_data_values(cfg: DictConfig) -> None:
    """``data.path`` (an empty file), ``data.seq_len`` and ``data.num_workers`` (the data module's own checks run in
    every rank)."""
    data = cfg.get("data")
    if not OmegaConf.is_dict(data):
        return
    seq_len, workers, path = data.get("seq_len"), data.get("num_workers"), data.get("path")
    if isinstance(path, str) and os.path.isfile(path) and os.path.getsize(path) == 0:
        # Seen: torch's "both buffer length (0) and count (-1) must not be 0" from every rank after start-up.
        raise ValueError(f"data.path={path} is an empty file: give a file with data, or data.path=null for the "
                         "built-in data.")
    if _whole(seq_len) and seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len} must be 1 or more tokens (e.g. data.seq_len=128).")
    if _whole(workers) and workers < 0:
        raise ValueError(f"data.num_workers={workers} is negative: give 0 (load in the training process) or more.")
