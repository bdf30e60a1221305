"""What a run actually uses, from its composed config: the config rescaled for the layout (the arithmetic of
:mod:`lightning_parallel.scaling`, applied at the paths ``scaling.apply_to`` names), the overrides that rerun the same
optimisation at another device count, the run's summary (the head of ``metrics.json`` and of the logged
hyperparameters) and ``.hydra/effective.yaml``. :mod:`lightning_parallel.cli.train` calls them before fitting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_parallel.cli.run_folder import job_label
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.scaling import EffectiveHparams, Reference, check_width_rule, rescale_for_layout

_ABSENT = object()


def _select(cfg: DictConfig, path: str) -> Any:
    value = OmegaConf.select(cfg, path, throw_on_missing=True)
    if value is None:
        raise ValueError(f"scaling.apply_to points at {path!r}, which is not in the config: fix scaling.apply_to.")
    return value


def width_settings(cfg: DictConfig) -> tuple[str, Any]:
    """``(scaling.width_rule, the model's base width)``, checked against each other before anything is built.

    The base width is read where ``scaling.apply_to.base_width`` points (``model.base_width``); the model applies
    μP itself from it (:mod:`lightning_parallel.mup`), the width rule only has to agree.

    Raises:
        ValueError: ``mup`` for a model that takes no base width or was given none, ``standard`` with one.
    """
    rule = str(cfg.scaling.get("width_rule") or "standard")
    key = str(cfg.scaling.apply_to.get("base_width") or "model.base_width")
    base_width = OmegaConf.select(cfg, key, default=_ABSENT)
    if rule == "mup" and base_width is _ABSENT:
        target = OmegaConf.select(cfg, "model._target_", default="?")
        raise ValueError(f"scaling.width_rule=mup needs {key}, and the model ({target}) takes none: μP is built for "
                         "the GPT recipe (model=gpt) and Hugging Face decoders (model=hf_causal_lm). A model of your "
                         "own that applies it names its setting in scaling.apply_to.base_width.")
    base_width = None if base_width is _ABSENT else base_width
    check_width_rule(rule, base_width, key)
    return rule, base_width


def apply_scaling(cfg: DictConfig, layout: ParallelLayout) -> EffectiveHparams:
    """Rescale the config in place for ``layout`` (see :mod:`lightning_parallel.scaling`) and return the result.

    The effective values replace the configured ones at the paths ``scaling.apply_to``
    names, before anything is built, and are kept under ``scaling.effective`` so that the
    logged hyperparameters and the saved ``effective.yaml`` carry them.

    Args:
        cfg: the composed config (changed in place).
        layout: the run's resolved layout; only its data-parallel size counts.
    """
    scaling = cfg.scaling
    targets = scaling.apply_to
    reference = Reference(**OmegaConf.to_container(scaling.reference, resolve=True))
    width_rule, base_width = width_settings(cfg)
    effective = rescale_for_layout(
        scaling.rule,
        reference,
        layout,
        micro_batch_size=int(_select(cfg, targets.micro_batch_size)),
        accumulate_grad_batches=int(_select(cfg, targets.accumulate_grad_batches)),
        lr=float(_select(cfg, targets.lr)),
        warmup_steps=int(_select(cfg, targets.warmup_steps)) if targets.get("warmup_steps") else 0,
        width_rule=width_rule,
        base_width=base_width,
    )
    with open_dict(cfg):
        OmegaConf.update(cfg, targets.micro_batch_size, effective.micro_batch_size)
        OmegaConf.update(cfg, targets.accumulate_grad_batches, effective.accumulate_grad_batches)
        OmegaConf.update(cfg, targets.lr, effective.lr)
        if targets.get("warmup_steps"):
            OmegaConf.update(cfg, targets.warmup_steps, effective.warmup_steps)
        cfg.scaling.effective = effective.as_dict()
    return effective


def reproduce_overrides(effective: EffectiveHparams) -> list[str]:
    """Overrides that rerun this run's optimisation (global batch, lr, warm-up) at any device count.

    Args:
        effective: the run's effective values.
    """
    ref = effective.as_reference()
    return [
        "scaling=fixed_global_batch",
        f"scaling.reference.global_batch_size={ref.global_batch_size}",
        f"scaling.reference.lr={ref.lr!r}",
        f"scaling.reference.warmup_steps={ref.warmup_steps}",
        f"scaling.reference.devices={ref.devices}",
    ] + (["scaling.width_rule=mup"] if effective.width_rule == "mup" else [])  # the base width is in the model config


def _job_info() -> dict[str, Any]:
    """:func:`~lightning_parallel.cli.run_folder.job_label` of this job, its overrides as the one string Hydra names
    the job by (``override_dirname``: what ``metrics.json`` and the sweep summary show); empty outside a Hydra app."""
    label = job_label()
    if not label:
        return {}
    from hydra.core.hydra_config import HydraConfig

    return {**label, "overrides": HydraConfig.get().job.override_dirname}


def run_summary(cfg: DictConfig, strategy: Any, layout: ParallelLayout, effective: EffectiveHparams) -> dict[str, Any]:
    """What a run is, in plain values: the head of ``metrics.json`` and of the logged hyperparameters.

    Args:
        cfg: the job's config (after rescaling).
        strategy: the strategy object or name.
        layout: the resolved layout.
        effective: the effective hyperparameters.
    """
    job = _job_info()
    return {
        "strategy": job.get("strategy") or (strategy if isinstance(strategy, str) else type(strategy).__name__),
        "strategy_class": strategy if isinstance(strategy, str) else type(strategy).__name__,
        "experiment": job.get("experiment"),
        "overrides": job.get("overrides", ""),
        "devices": layout.world_size // int(cfg.trainer.num_nodes),
        "num_nodes": int(cfg.trainer.num_nodes),
        "world_size": layout.world_size,
        "layout": layout.describe(),
        "effective": effective.as_dict(),
        "reference": OmegaConf.to_container(cfg.scaling.reference, resolve=True),
        "reproduce": " ".join(reproduce_overrides(effective)),
        "output_dir": str(cfg.paths.output_dir),
    }


def save_effective_config(cfg: DictConfig, summary: dict[str, Any]) -> Path:
    """Write the resolved config with the effective values to ``<output_dir>/.hydra/effective.yaml``.

    Note:
        Hydra's own ``.hydra/config.yaml`` holds the values *before* rescaling. This file
        holds what the run used, plus the overrides that rerun the same optimisation at
        another device count (``reproduce``), so the run can be repeated without redoing
        the arithmetic.

    Args:
        cfg: the job's config (after rescaling).
        summary: :func:`run_summary` of the run.
    """
    path = Path(cfg.paths.output_dir) / ".hydra" / "effective.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {k: summary[k] for k in ("strategy", "devices", "num_nodes", "layout", "reproduce")}
    path.write_text(OmegaConf.to_yaml({"run": header, **OmegaConf.to_container(cfg, resolve=True)}))
    return path
