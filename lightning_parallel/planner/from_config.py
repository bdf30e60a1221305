"""The planner's inputs from a composed ``lp-train`` config: the model's shape, the batch and the world.

The model is instantiated from ``cfg.model`` (random init, on this machine) and measured on one
batch of ``cfg.data``: what ``lp-train`` would build, so the parameters are exact.
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.planner.candidates import CHECKPOINTING, Workload
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.scaling import Reference


def workload_of(cfg: Any) -> Workload:
    """The batch, accumulation, lr and scaling rule ``lp-train`` would start from (``scaling.apply_to`` paths)."""
    from omegaconf import OmegaConf

    targets = cfg.scaling.apply_to
    reference = Reference(**OmegaConf.to_container(cfg.scaling.reference, resolve=True))
    select = lambda path: OmegaConf.select(cfg, path)  # noqa: E731
    warmup = select(targets.warmup_steps) if targets.get("warmup_steps") else 0
    return Workload(cfg.scaling.rule, reference, int(select(targets.micro_batch_size)),
                    int(select(targets.accumulate_grad_batches) or 1), float(select(targets.lr)), int(warmup or 0))


def checkpointing_modes() -> tuple[str, ...]:
    """The activation checkpointing modes the hybrid strategy offers (``none`` alone until it has the option)."""
    from dataclasses import fields

    from lightning_parallel.parallel.options import ParallelOptions

    return CHECKPOINTING if any(f.name == "activation_checkpointing" for f in fields(ParallelOptions)) else ("none",)


def _optimizer_states(cfg: Any) -> int:
    target = str(cfg.model.get("optimizer", {}).get("_target_", "torch.optim.AdamW"))
    name = target.rsplit(".", 1)[-1].lower()
    if name.startswith("adam") or name in ("lamb", "lion"):
        return 1 if name == "lion" else 2
    return 1 if name == "sgd" and cfg.model.optimizer.get("momentum") else 0


def shape_of(cfg: Any) -> ModelShape:
    """Instantiate ``cfg.model`` and measure it on one batch of ``cfg.data`` (seed ``cfg.seed``).

    Raises:
        ValueError: the model offers no ``pipeline_layers()``, or its first layer does not take one tensor.
    """
    import torch
    from hydra.utils import instantiate

    from lightning_parallel.planner.profile import profile_module
    from lightning_parallel.protocol import split_batch

    torch.manual_seed(int(cfg.get("seed", 0)))
    model = instantiate(cfg.model)
    if not hasattr(model, "pipeline_layers"):
        raise ValueError(f"{type(model).__name__} offers no pipeline_layers(): the planner measures a model layer by "
                         "layer (see the module protocol in docs/protocol.md), or plan a published shape with --shape.")
    data = instantiate(cfg.data)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    inputs, _ = split_batch(model, batch)
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"{type(model).__name__}'s first pipeline layer takes {type(inputs).__name__}, not one "
                         "tensor: the planner can measure only single-tensor inputs; plan with a cluster whose "
                         "compute is 'peak' after describing the model, or plan a published shape with --shape.")
    name = str(cfg.model._target_).rsplit(".", 1)[-1]
    return profile_module(model, inputs, name=name, optimizer_states=_optimizer_states(cfg))
