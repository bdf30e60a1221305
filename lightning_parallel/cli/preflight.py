"""Checks the entry point runs before any process starts, and the one error line a user sees.

``lp-train`` builds the strategy and checks its layout against the world, the schedule against
the pipeline size and the model against both in the launching process, in that order, so the
first error is the cause. Messages name the settings as the user typed them
(``strategy.pipeline_parallel_size=3``, ``trainer.devices=4``) and are printed once, as
``lp-train: error: ...`` with exit code 2; the Python API raises ``ValueError`` as before.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.layout import ParallelLayout

# How layout messages name each setting: the Hydra paths a user of ``lp-train`` types.
SETTING_NAMES = {
    "data_parallel": "strategy.data_parallel_size",
    "pipeline_parallel": "strategy.pipeline_parallel_size",
    "tensor_parallel": "strategy.tensor_parallel_size",
    "context_parallel": "strategy.context_parallel_size",
    "expert_parallel": "strategy.expert_parallel_size",
    "devices": "trainer.devices",
    "num_nodes": "trainer.num_nodes",
}


class ConfigError(ValueError):
    """A configuration the entry point refuses before any process starts (printed once, exit code 2)."""


def world_size_of(cfg: DictConfig) -> int:
    """Processes in the run: ``trainer.devices x trainer.num_nodes`` (devices as a count)."""
    devices = (
        OmegaConf.to_container(cfg.trainer.devices) if OmegaConf.is_list(cfg.trainer.devices) else cfg.trainer.devices
    )
    if isinstance(devices, list):
        devices = len(devices)
    elif isinstance(devices, str) and re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", devices):
        devices = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(
            f"trainer.devices={devices!r} is not a device count: give an explicit positive count (e.g. "
            "trainer.devices=2) so the layout can be checked before processes start."
        )
    return devices * int(cfg.trainer.num_nodes)


def layout_of(strategy: Any, world_size: int, num_nodes: int = 1) -> ParallelLayout:
    """The layout a strategy will use (:func:`lightning_parallel.strategies.resolve.resolve_layout`).

    Errors name the settings as ``lp-train`` users type them (:data:`SETTING_NAMES`).

    Args:
        strategy: an object, a class, a zero-argument factory or a registered name (``"pipeline_parallel"``).
        world_size: processes in the run.
        num_nodes: nodes in the run (for the messages).
    """
    from lightning_parallel.strategies.resolve import resolve_layout

    return resolve_layout(strategy, world_size, names=SETTING_NAMES, num_nodes=num_nodes)


def qualified(message: str, prefix: str = "strategy.") -> str:
    """``zero_stage=1`` -> ``strategy.zero_stage=1``: the strategy's argument names as the settings users type."""
    from dataclasses import fields

    from lightning_parallel.parallel.options import ParallelOptions

    names = "|".join(f.name for f in fields(ParallelOptions))
    return re.sub(rf"(?<![\w.'\"])({names})(?=\s?(?:[<>!]?=|[<>]))", rf"{prefix}\1", message)


def _build_strategy(cfg: DictConfig) -> Any:
    """The strategy object (a plain string such as ``ddp`` is passed to Lightning as it is)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if isinstance(cfg.strategy, str):
        return cfg.strategy
    try:
        return instantiate(cfg.strategy)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, ValueError):
            raise exc.__cause__ from None
        raise


def _strategy_object(strategy: Any) -> Any:
    """The strategy object behind a registered name (``pipeline_parallel``) or the object itself."""
    from lightning_parallel.strategies.resolve import strategy_object

    return strategy_object(strategy) if isinstance(strategy, str) else strategy


# Lightning's short precision names, as its connector unifies them (what check_precision is given in a rank).
_UNIFIED_PRECISION = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}


def _check_precision(cfg: DictConfig, strategy: Any, layout: ParallelLayout) -> None:
    """A Trainer precision the strategy's options cannot run as asked fails here, not inside every rank."""
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.parallel.precision import check_precision

    options = getattr(_strategy_object(strategy), "options", None)
    if not isinstance(options, ParallelOptions):
        return
    precision = str(cfg.trainer.get("precision", "32-true"))
    check_precision(_UNIFIED_PRECISION.get(precision, precision), options, layout)


def meta_model(cfg: DictConfig) -> Any:
    """``cfg.model`` built on the meta device (``configure_model`` included); None when it needs the Trainer."""
    import torch
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    with torch.device("meta"):
        try:
            model = instantiate(cfg.model)
        except InstantiationException as exc:
            if isinstance(exc.__cause__, ValueError):
                raise exc.__cause__ from None
            raise
        try:  # a model built in configure_model (on meta under the suite's strategies, as here)
            getattr(model, "configure_model", lambda: None)()
        except (RuntimeError, AttributeError):
            return None  # it needs the Trainer or the mesh: the strategy checks it in setup, before any step
    return model


def check_model_builds(cfg: DictConfig) -> None:
    """Build ``cfg.model`` on the meta device once, so a model that refuses its settings (``model.n_head=3`` with
    ``d_model=32``, ``model.dropout=1.5``) fails here, naming ``model.<key>``, not in every rank after start-up.

    A model that cannot be built on the meta device for another reason is left to the run (no refusal).

    Raises:
        ValueError: the model's own ``ValueError``, its arguments named as ``model.<key>``.
    """
    model_cfg = cfg.get("model")
    if not OmegaConf.is_dict(model_cfg):
        return
    try:
        meta_model(cfg)
    except ValueError as exc:
        message, names = str(exc), "|".join(re.escape(str(key)) for key in model_cfg.keys())
        named = re.sub(rf"(?<![\w.])({names})(?=\s?=)", r"model.\1", message) if names else message
        if not re.search(r"(?<![\w.])model\.\w+\s?=", named):  # names no setting: say which model refused
            named = f"model ({model_cfg.get('_target_', '?')}): {message}"
        raise ValueError(named) from exc
    except Exception:  # noqa: BLE001 - needs the Trainer, a device, files: the run builds it as before
        return


def _check_model(cfg: DictConfig, strategy: Any, layout: ParallelLayout) -> None:
    """Check the model against the layout (stages vs. layers, tensor size vs. heads) on the meta device."""
    from lightning_parallel.parallel.compose import check_module

    options = getattr(_strategy_object(strategy), "options", None)
    if options is None or not (layout.pipeline_parallel_enabled or layout.tensor_parallel_enabled
                               or layout.context_parallel_enabled):
        return
    model = meta_model(cfg)
    if model is not None:
        check_module(model, layout, options)


def _pretrained_folders(cfg: DictConfig) -> list[tuple[str, Optional[str], str]]:
    """``(folder, prefix or None, the setting naming it)`` of ``model.pretrained`` and ``HuggingFaceWeights``
    callbacks."""
    found = []
    model = cfg.get("model")
    if OmegaConf.is_dict(model) and model.get("pretrained"):
        found.append((str(model.pretrained), None, "model.pretrained"))
    callbacks = cfg.get("callbacks")
    for name, callback in (callbacks.items() if OmegaConf.is_dict(callbacks) else []):
        if OmegaConf.is_dict(callback) and str(callback.get("_target_", "")).endswith("HuggingFaceWeights"):
            found.append((str(callback.get("folder")), callback.get("prefix"), f"callbacks.{name}.folder"))
    return found


def _check_pretrained(cfg: DictConfig) -> None:
    """A ``save_pretrained`` folder that does not fit the model (keys, shapes, as ``from_pretrained`` matches them)
    fails here, naming the difference, not in every rank after start."""
    folders = _pretrained_folders(cfg)
    model = meta_model(cfg) if folders else None
    if model is None:
        return
    from lightning_parallel.callbacks.hf_weights import hf_model_prefix
    from lightning_parallel.checkpoints.hf.load import match_folder

    for folder, prefix, setting in folders:
        try:
            match_folder(model, Path(folder), prefix if prefix is not None else hf_model_prefix(model))
        except ValueError as exc:
            raise ValueError(f"{setting}={folder}: {exc}") from exc


def _check_sequence(cfg: DictConfig, layout: ParallelLayout) -> None:
    """Context parallelism cuts every sequence into 2 x context-size chunks: ``data.seq_len`` must divide."""
    seq_len = cfg.get("data", {}).get("seq_len") if OmegaConf.is_dict(cfg.get("data")) else None
    step = 2 * layout.context_parallel
    if layout.context_parallel_enabled and isinstance(seq_len, int) and seq_len % step:
        raise ValueError(
            f"data.seq_len={seq_len} does not split into {step} equal chunks (2 per context rank, for causal load "
            f"balance) under strategy.context_parallel_size={layout.context_parallel}: use data.seq_len="
            f"{seq_len - seq_len % step or step} or {seq_len + step - seq_len % step}."
        )


def trainer_arguments() -> list[str]:
    """The arguments ``lightning.pytorch.Trainer`` takes (what ``trainer.*`` may set)."""
    import inspect

    from lightning.pytorch import Trainer

    return [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]


def unknown_trainer_key(key: str, value: str = "<value>") -> Optional[str]:
    """The error for ``trainer.<key>`` that the Trainer does not take, with the closest names; None when it does.

    Args:
        key: the name after ``trainer.``.
        value: the value given (shown in the suggestion).
    """
    import difflib

    known = trainer_arguments()
    if key in known or key.startswith("_"):
        return None
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f"did you mean trainer.{close[0]}={value}?" if close else "see lightning.pytorch.Trainer's arguments"
    others = f" (also close: {', '.join(close[1:])})" if len(close) > 1 else ""
    return f"trainer.{key} is not a Trainer argument: {hint}{others}"


def check_trainer_overrides(overrides: list[str]) -> None:
    """Refuse ``trainer.<key>=...`` overrides the Trainer does not take, before Hydra composes anything.

    Raises:
        ConfigError: an unknown key, with "did you mean".
    """
    for override in overrides:
        match = re.fullmatch(r"[+~]{0,2}trainer\.([A-Za-z_][\w]*)(?:=(.*))?", override)
        if match:
            problem = unknown_trainer_key(match.group(1), match.group(2) or "<value>")
            if problem:
                raise ConfigError(problem)


def _check_trainer(cfg: DictConfig) -> None:
    """Unknown Trainer keys (from a config file) and an accelerator this machine does not have."""
    for key in cfg.trainer:
        problem = unknown_trainer_key(str(key))
        if problem:
            raise ValueError(problem)
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("auto", "cpu"):
        return
    from lightning.pytorch.accelerators import AcceleratorRegistry

    name = "cuda" if accelerator == "gpu" else accelerator
    if name not in AcceleratorRegistry:
        known = ", ".join(sorted(AcceleratorRegistry.available_accelerators()))
        raise ValueError(f"trainer.accelerator={accelerator} is not an accelerator Lightning knows ({known}, auto)")
    if not AcceleratorRegistry.get(name).is_available():
        raise ValueError(f"trainer.accelerator={accelerator}, but this machine has no {name} device: "
                         f"use trainer.accelerator=cpu (or auto, which picks what is there)")


def _check_data(cfg: DictConfig) -> None:
    """A ``data.path`` (or ``data.files`` / ``data.val_files`` / ``data.tokenizer`` of data=hf_text) that does not
    exist fails here, not inside every rank."""
    data = cfg.get("data") if OmegaConf.is_dict(cfg.get("data")) else {}
    path = data.get("path")
    if path is not None and not os.path.exists(str(path)):
        raise ValueError(f"data.path={path} does not exist (looked from {os.getcwd()}): give an existing "
                         "file or folder, or data.path=null for the built-in data")
    if "files" in data and not data.get("files"):
        raise ValueError("data.files is empty: give a file or folder, e.g. data.files=/path/train.jsonl "
                         "or data.files=[a.jsonl,b.parquet]")
    for key in ("files", "val_files", "tokenizer"):
        value = data.get(key)
        for name in (value if OmegaConf.is_list(value) else [] if value is None else [value]):
            if not os.path.exists(os.path.expanduser(str(name))):
                raise ValueError(f"data.{key}: {name} does not exist (looked from {os.getcwd()})")


def preflight(cfg: DictConfig) -> tuple[Any, ParallelLayout]:
    """Build the strategy and check the trainer, data, layout and model, before any process starts.

    Raises:
        ConfigError: the first thing that cannot work, in the order trainer, targets, data, strategy choices, sizes,
            world, schedule, batch and lr after rescaling, micro-batches, optimizer, precision, model, pretrained
            weights.
    """
    from lightning_parallel.cli import value_checks as values
    from lightning_parallel.cli.target_checks import check_targets

    try:
        _check_trainer(cfg)
        values.check_float8_strategy(cfg)  # before check_targets: its unknown-key message names no fix for this
        check_targets(cfg)
        values.check_trainer_values(cfg)
        _check_data(cfg)
        values.check_data_values(cfg)
        values.check_strategy_choices(cfg)
        strategy = _build_strategy(cfg)
        layout = layout_of(strategy, world_size_of(cfg), int(cfg.trainer.num_nodes))
        effective = values.check_scaling(cfg, layout)
        values.check_microbatches(cfg, layout, effective.micro_batch_size)
        values.check_optimizer(cfg)
        _check_precision(cfg, strategy, layout)
        check_model_builds(cfg)
        _check_model(cfg, strategy, layout)
        _check_pretrained(cfg)
        _check_sequence(cfg, layout)
    except ValueError as exc:
        raise ConfigError(qualified(str(exc))) from exc
    return strategy, layout


def report_config_error(error: ConfigError) -> None:
    """Print ``lp-train: error: ...`` once (rank 0 or the launching process) and exit with code 2.

    In a multirun the error is raised instead, so that Hydra records the job as failed.

    Args:
        error: the error (its traceback goes to the run's log file, not the console).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise error
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"lp-train: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)
