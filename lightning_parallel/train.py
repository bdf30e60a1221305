"""Hydra entry point: compose -> rescale -> instantiate -> fit -> report.

Run ``python -m lightning_parallel.train`` (or ``lp-train``) with Hydra overrides, e.g.
``lp-train strategy=pipeline trainer.devices=2`` or
``lp-train -m strategy=ddp trainer.devices=1,2``. With ``trainer.devices > 1`` and no
external launcher (torchrun, SLURM) the entry point starts the other local ranks itself
(see :mod:`lightning_parallel.launch`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.preflight import ConfigError, preflight, report_config_error
from lightning_parallel.preflight import layout_of as layout_of  # re-exported: tests and recipes use them
from lightning_parallel.preflight import world_size_of as world_size_of
from lightning_parallel.scaling import EffectiveHparams, Reference, rescale_for_layout
from lightning_parallel.sweep_summary import METRICS_FILE

# The Hydra configs: inside the package once installed (the wheel carries conf/ as lightning_parallel/conf),
# else conf/ beside the package (a source checkout, editable or not).
_PACKAGE = Path(__file__).resolve().parent
CONFIG_DIR = str(_PACKAGE / "conf" if (_PACKAGE / "conf" / "config.yaml").is_file() else _PACKAGE.parent / "conf")


def _select(cfg: DictConfig, path: str) -> Any:
    value = OmegaConf.select(cfg, path, throw_on_missing=True)
    if value is None:
        raise ValueError(f"scaling.apply_to points at {path!r}, which is not in the config: fix scaling.apply_to.")
    return value


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
    effective = rescale_for_layout(
        scaling.rule,
        reference,
        layout,
        micro_batch_size=int(_select(cfg, targets.micro_batch_size)),
        accumulate_grad_batches=int(_select(cfg, targets.accumulate_grad_batches)),
        lr=float(_select(cfg, targets.lr)),
        warmup_steps=int(_select(cfg, targets.warmup_steps)) if targets.get("warmup_steps") else 0,
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
    ]


def _job_info() -> dict[str, Any]:
    """The Hydra choices and overrides of this job (empty outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.get()
    return {
        "strategy": hydra_cfg.runtime.choices.get("strategy"),
        "experiment": hydra_cfg.runtime.choices.get("experiment"),
        "overrides": hydra_cfg.job.override_dirname,
    }


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


def log_final_hparams(logger: Any, summary: dict[str, Any], metrics: dict[str, float]) -> None:
    """Log the layout and effective hyperparameters with the final metrics (TensorBoard's HParams tab).

    Args:
        logger: the run's Lightning logger.
        summary: :func:`run_summary` of the run.
        metrics: the final metrics.
    """
    params = {k: summary[k] for k in ("strategy", "devices", "num_nodes", "world_size", "layout")}
    params.update({f"effective/{k}": v for k, v in summary["effective"].items()})
    params.update({f"reference/{k}": v for k, v in summary["reference"].items() if v is not None})
    wanted = ("val_loss", "train_loss", "throughput/samples_per_sec", "throughput/tokens_per_sec")
    final = {f"hp/{k.split('/')[-1]}": metrics[k] for k in wanted if k in metrics}
    if final:
        logger.log_hyperparams(params, metrics=final)
        # fit() already closed the writer; this write reopened it, so close it again to flush.
        logger.finalize("success")


def fit_metrics(trainer: Any, datamodule: Any) -> dict[str, float]:
    """Scalar metrics at the end of fit, plus callback summaries (throughput, evaluation) and the data baseline.

    Training throughput appears once, as ``throughput/*`` from :class:`~lightning_parallel.callbacks.ThroughputReport`.

    Args:
        trainer: the Trainer after ``fit``.
        datamodule: the run's data module (``unigram_baseline()`` is added when it has one).
    """
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    for callback in trainer.callbacks:
        metrics.update(getattr(callback, "summary", {}) or {})
    baseline = getattr(datamodule, "unigram_baseline", None)
    if callable(baseline):
        metrics["unigram_baseline"] = baseline()
    return metrics


def train(cfg: DictConfig, prepared: Optional[tuple[Any, ParallelLayout]] = None) -> dict[str, float]:
    """Build everything from ``cfg`` and fit; returns the final metrics (same on every rank).

    Rank 0 also writes ``<output_dir>/.hydra/effective.yaml`` before fitting and
    ``<output_dir>/metrics.json`` after (read by :class:`lightning_parallel.sweep_summary.SweepSummary`).

    Args:
        cfg: the composed Hydra config (``conf/config.yaml`` plus overrides).
        prepared: :func:`preflight` of ``cfg`` when the caller already ran it.
    """
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_parallel.report import print_table

    pl.seed_everything(cfg.seed, workers=True)
    strategy, layout = prepared or preflight(cfg)
    effective = apply_scaling(cfg, layout)
    summary = run_summary(cfg, strategy, layout, effective)

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not logger:
        # LearningRateMonitor refuses to run without a logger; `logger=none` should just work.
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    if logger:
        logger.log_hyperparams({"layout": layout.describe(), **OmegaConf.to_container(cfg, resolve=True)})
    if rank_zero_only.rank == 0:
        save_effective_config(cfg, summary)
        print_table("lightning_parallel: run", _startup_table(cfg, strategy, layout, effective, logger, summary))

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = fit_metrics(trainer, datamodule)
    if rank_zero_only.rank == 0:
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in sorted(metrics.items())]
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") if trainer.checkpoint_callback else ""
        rows.append(("checkpoint", best or "-"))
        print_table("lightning_parallel: result", rows)
        write_metrics(Path(cfg.paths.output_dir), summary, metrics)
        if logger:
            log_final_hparams(logger, summary, metrics)
    return metrics


def write_metrics(output_dir: Path, summary: dict[str, Any], metrics: dict[str, float]) -> Path:
    """Write ``metrics.json``: the run summary and its final metrics (one job of a sweep).

    Args:
        output_dir: the job's output folder.
        summary: :func:`run_summary` of the run.
        metrics: the final metrics.
    """
    path = output_dir / METRICS_FILE
    path.write_text(json.dumps({**summary, "metrics": metrics}, indent=2, sort_keys=True, default=str))
    return path


def _startup_table(cfg: DictConfig, strategy: Any, layout: ParallelLayout, effective: EffectiveHparams,
                   logger: Any, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the start-up table (see :func:`lightning_parallel.report.startup_rows`)."""
    import torch

    from lightning_parallel.report import startup_rows

    paths = {"output": cfg.paths.output_dir, "logs": getattr(logger, "log_dir", "-"), "checkpoints": cfg.paths.checkpoint_dir}
    extra = dict(strategy.startup_rows(layout)) if hasattr(strategy, "startup_rows") else {}
    extra["same run on other devices"] = summary["reproduce"]
    reference = OmegaConf.to_container(cfg.scaling.reference, resolve=True)
    accelerator = cfg.trainer.accelerator
    cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    return startup_rows(summary["strategy"], layout, effective, reference, "cuda" if cuda else "cpu",
                        cfg.trainer.num_nodes, paths, extra)


def run(cfg: DictConfig) -> Optional[float]:
    """Run one job, starting the other local ranks first when this process is the only one."""
    import torch.distributed as dist
    from hydra.core.hydra_config import HydraConfig

    from lightning_parallel.launch import local_ranks, processes_to_launch, restored_rank_environment

    try:
        nprocs = processes_to_launch(cfg.trainer.devices, int(cfg.trainer.num_nodes))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    prepared = preflight(cfg)  # before any other rank starts: a bad layout is reported once
    try:
        with restored_rank_environment():
            if nprocs:
                with local_ranks(cfg, Path(HydraConfig.get().runtime.output_dir), nprocs):
                    metrics = train(cfg, prepared)
            else:
                metrics = train(cfg, prepared)
    finally:
        # A multirun runs the next job in this process; it must start from a clean slate.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    monitor = cfg.get("optimized_metric")
    return metrics.get(monitor) if monitor else None


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> Optional[float]:
    """Console entry point (``lp-train``)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    try:
        return run(cfg)
    except ConfigError as error:
        report_config_error(error)
        return None


if __name__ == "__main__":
    main()
