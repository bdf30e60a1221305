"""Hydra entry point: compose -> rescale -> instantiate -> fit -> report.

Run ``python -m lightning_parallel.train`` (or ``lp-train``) with Hydra overrides, e.g.
``lp-train strategy=pipeline trainer.devices=2`` or
``lp-train -m strategy=ddp trainer.devices=1,2``. With ``trainer.devices > 1`` and no
external launcher (torchrun, SLURM) the entry point starts the other local ranks itself
(see :mod:`lightning_parallel.launch`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.scaling import EffectiveHparams, Reference, rescale

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _select(cfg: DictConfig, path: str) -> Any:
    value = OmegaConf.select(cfg, path, throw_on_missing=True)
    if value is None:
        raise ValueError(f"scaling.apply_to points at {path!r}, which is not in the config: fix scaling.apply_to.")
    return value


def world_size_of(cfg: DictConfig) -> int:
    """Processes in the run: ``trainer.devices x trainer.num_nodes`` (devices as a count)."""
    devices = cfg.trainer.devices
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        devices = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(
            f"trainer.devices={devices!r}: give an explicit positive device count so the layout can be checked "
            "before processes start."
        )
    return devices * int(cfg.trainer.num_nodes)


def layout_of(strategy: Any, world_size: int) -> ParallelLayout:
    """The layout a strategy will use: its own for the suite's strategies, data-parallel otherwise."""
    resolve = getattr(strategy, "resolve_layout", None)
    if callable(resolve):
        return resolve(world_size)
    return ParallelLayout.resolve(world_size, data_parallel="auto")


def apply_scaling(cfg: DictConfig, layout: ParallelLayout) -> EffectiveHparams:
    """Rescale the config in place for ``layout`` (see :mod:`lightning_parallel.scaling`) and return the result."""
    scaling = cfg.scaling
    targets = scaling.apply_to
    reference = Reference(**OmegaConf.to_container(scaling.reference, resolve=True))
    effective = rescale(
        scaling.rule,
        reference,
        data_parallel=layout.data_parallel,
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
    return effective


def train(cfg: DictConfig) -> dict[str, float]:
    """Build everything from ``cfg`` and fit; returns the final metrics (same on every rank).

    Args:
        cfg: the composed Hydra config (``conf/config.yaml`` plus overrides).
    """
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_parallel.report import print_table, startup_rows

    pl.seed_everything(cfg.seed, workers=True)
    world_size = world_size_of(cfg)
    # A plain string (``auto``, ``ddp``, a registered name) is passed to Lightning as it is.
    strategy = cfg.strategy if isinstance(cfg.strategy, str) else instantiate(cfg.strategy)
    layout = layout_of(strategy, world_size)
    effective = apply_scaling(cfg, layout)

    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    trainer: pl.Trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    if logger:
        logger.log_hyperparams({"effective": effective.as_dict(), "layout": layout.describe(), **OmegaConf.to_container(cfg, resolve=True)})

    paths = {"output": cfg.paths.output_dir, "logs": getattr(logger, "log_dir", "-"), "checkpoints": cfg.paths.checkpoint_dir}
    extra = strategy.startup_rows(layout) if hasattr(strategy, "startup_rows") else {}
    if rank_zero_only.rank == 0:
        reference = OmegaConf.to_container(cfg.scaling.reference, resolve=True)
        accelerator = "cuda" if cfg.trainer.accelerator in ("cuda", "gpu") or (cfg.trainer.accelerator == "auto" and torch.cuda.is_available()) else "cpu"
        name = strategy if isinstance(strategy, str) else type(strategy).__name__
        rows = startup_rows(name, layout, effective, reference, accelerator, cfg.trainer.num_nodes, paths, extra)
        print_table("lightning_parallel: run", rows)

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    for callback in trainer.callbacks:
        metrics.update(getattr(callback, "summary", {}) or {})
    baseline = getattr(datamodule, "unigram_baseline", None)
    if callable(baseline):
        metrics["unigram_baseline"] = baseline()
    if rank_zero_only.rank == 0:
        rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in sorted(metrics.items())]
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") if trainer.checkpoint_callback else ""
        rows.append(("checkpoint", best or "-"))
        print_table("lightning_parallel: result", rows)
    return metrics


def run(cfg: DictConfig) -> Optional[float]:
    """Run one job, starting the other local ranks first when this process is the only one."""
    import torch.distributed as dist
    from hydra.core.hydra_config import HydraConfig

    from lightning_parallel.launch import local_ranks, processes_to_launch, restored_rank_environment

    nprocs = processes_to_launch(cfg.trainer.devices, int(cfg.trainer.num_nodes))
    try:
        with restored_rank_environment():
            if nprocs:
                with local_ranks(cfg, Path(HydraConfig.get().runtime.output_dir), nprocs):
                    metrics = train(cfg)
            else:
                metrics = train(cfg)
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
    return run(cfg)


if __name__ == "__main__":
    main()
