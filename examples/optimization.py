"""What the recipes' ``configure_optimizers`` share: weight-decay groups and a warm-up/cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn


def weight_decay_groups(
    module: nn.Module, weight_decay: float, exempt: Callable[[str], bool] = lambda name: False
) -> list[dict[str, Any]]:
    """Optimizer parameter groups: matrices decay; vectors (biases, norms) and exempt names do not.

    Note:
        Groups are built from the parameters the module holds *now*: under a pipeline split
        that is only this rank's stages, so a group can be empty, and empty groups are
        dropped (an optimizer refuses one). A parameter DeepSpeed ZeRO-3 partitioned as it was
        created (``deepspeed.zero.Init``) counts by its full shape (``ds_shape``), not by its local slice.

    Args:
        module: the model (frozen parameters are left out).
        weight_decay: decay of the decaying group.
        exempt: ``exempt(name)`` is true for a matrix that must not decay either (an
            embedding or position table), by its ``named_parameters`` name.
    """
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 and not exempt(name) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warm-up, then cosine decay to ``min_ratio``.

    Args:
        step: the optimizer step (from 0).
        warmup_steps: steps of linear warm-up (0: none).
        max_steps: the step where the decay ends; at or below ``warmup_steps`` the rate stays flat.
        min_ratio: the multiplier the decay ends at.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def with_warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int) -> dict[str, Any]:
    """``configure_optimizers``'s answer: ``optimizer`` with a per-step :func:`warmup_cosine` schedule.

    Args:
        optimizer: the optimizer, built from the recipe's parameter groups.
        warmup_steps: linear warm-up steps.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
    """
    schedule = partial(warmup_cosine, warmup_steps=warmup_steps, max_steps=max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
