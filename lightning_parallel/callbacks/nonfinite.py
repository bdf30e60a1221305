"""Stop (or skip the step) on every rank when any rank's gradients are NaN or infinite.

Note:
    A non-finite loss on one rank poisons the averaged gradients of all of them, and a
    rank that raises alone leaves the others waiting in the next collective. The check
    runs in ``on_before_optimizer_step`` -- after the last backward of the step (and the
    strategy's gradient reduction), before clipping and the update -- and the ranks agree
    on the verdict with one all-reduce, so all of them stop, or all skip, together.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer
from typing_extensions import override

ACTIONS = ("stop", "skip")


def _local_finite(optimizer: Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            if not bool(torch.isfinite(local).all()):
                return False
    return True


class NonFiniteGuard(pl.Callback):
    """Checks the gradients of every optimizer step on all ranks before the update.

    Args:
        action: ``"stop"`` raises a ``RuntimeError`` naming the step on every rank;
            ``"skip"`` drops this step's gradients (the optimizer leaves the weights and its
            state untouched) and training goes on.
    """

    def __init__(self, action: Literal["stop", "skip"] = "stop") -> None:
        if action not in ACTIONS:
            raise ValueError(f"action={action!r}: use 'stop' or 'skip'.")
        self.action = action
        self.skipped_steps: list[int] = []

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        bad = torch.tensor(0.0 if _local_finite(optimizer) else 1.0, device=pl_module.device)
        bad = trainer.strategy.reduce(bad, reduce_op="max")
        if float(bad) == 0.0:
            return
        step = trainer.global_step
        if self.action == "stop":
            raise RuntimeError(
                f"Non-finite gradients at optimizer step {step} (epoch {trainer.current_epoch}, batch "
                f"{trainer.fit_loop.epoch_loop.batch_idx}) on at least one rank: stopping all ranks before the update. "
                "Lower the learning rate, enable gradient clipping, or use NonFiniteGuard(action='skip')."
            )
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # torch optimizers skip parameters without gradients
        self.skipped_steps.append(step)
        pl_module.print(f"[lightning_parallel] skipped optimizer step {step}: non-finite gradients on some rank")
