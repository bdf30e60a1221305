"""The MoE blocks' balancing loss, logging and expert-bias update under a pipeline schedule.

A pipeline schedule does not call ``training_step`` (where :func:`examples.nlp.moe.model_balancing_loss` forms the
loss on one process) and each rank holds one stage's blocks. The global balancing loss of a block is
``aux = w * E / (k Tm^2) * sum_e Cm_e * mean_r(s_e^r)`` (``examples/nlp/moe.py``'s Note): ``Cm`` and ``Tm`` are the
step's routed copies and tokens (all micro-batches, meaned over the data ranks) and carry no gradient, so the
gradient of this rank's share reaching the router is ``w * E / (k Tm^2) * Cm`` per unit of each micro-batch's
probability sums. :class:`PipelinedBalancing` puts exactly that gradient on the block's output in the backward
(:class:`_BalancingGradient`, as Megatron's ``MoEAuxLossAutoScaler`` attaches its auxiliary loss), with ``Cm`` and
``Tm`` taken once the step's last forward of the block has run. That needs every forward of the step before the
block's first backward: schedules ``gpipe`` and ``looped_bfs`` (the model refuses the others before start, and a
backward that comes too early raises). After the schedule, :meth:`PipelinedBalancing.step_end` gives the loss
value (summed over the stages) that joins the step's loss, logs what ``training_step`` logs on one process, and
updates the sigmoid router's bias over this stage's data ranks.

The hooks' ``step`` is the suite's ``PipelineStep`` (``lightning_parallel.parallel.pipeline.step_hooks``), used
by its attributes only: the recipes import nothing from the suite.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .moe import MoEFeedForward, balancing_factor, moe_blocks, routing_totals

FORWARDS_FIRST = ("gpipe", "looped_bfs")  # the suite's step_hooks.FORWARDS_FIRST, restated (no suite import)


class _BalancingGradient(torch.autograd.Function):
    """Identity on a block's output; in the backward, the balancing loss's gradient for the micro-batch's
    probability sums (its coefficient is known only once the step's forwards are done)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, prob_sums: Tensor, balancing: "PipelinedBalancing", block: nn.Module):
        ctx.balancing, ctx.block = balancing, block
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return grad, ctx.balancing.coefficient(ctx.block), None, None


class PipelinedBalancing:
    """The step-wide balancing loss of one rank's MoE blocks under a pipeline schedule (see the module docstring).

    Args:
        step: the suite's ``PipelineStep`` of this training step.
    """

    def __init__(self, step: Any) -> None:
        self.step = step
        self._coefficients: dict[nn.Module, Tensor] = {}
        self._totals: dict[nn.Module, tuple[Tensor, Tensor]] = {}  # block -> (Cm, Tm)

    def attach(self, block: MoEFeedForward, out: Tensor) -> Tensor:
        """``out`` carrying the block's balancing gradient; at the step's last forward of the block, its totals."""
        if not self.step.in_microbatch_forward():  # torch's shape-inference forward: not one of the step's
            block.forget_last_forward()
            return out
        stats = block.routing_stats
        if not block.aux_loss_weight:
            return out
        if len(stats) == self.step.microbatches and block not in self._totals:
            self._totals[block] = routing_totals(stats, self.step.data_mean)
            counts, tokens = self._totals[block]
            scale = block.aux_loss_weight * balancing_factor(block.num_experts, block.top_k, tokens)
            self._coefficients[block] = (scale * counts * self.step.loss_scale).detach()
        return _BalancingGradient.apply(out, stats[-1].prob_sums, self, block)

    def coefficient(self, block: nn.Module) -> Tensor:
        """The gradient of the balancing loss per unit of one micro-batch's probability sums of ``block``."""
        if block not in self._coefficients:
            raise RuntimeError(
                f"A backward of the pipeline schedule {self.step.schedule!r} reached an MoE block before the step's "
                f"last forward of it: its balancing loss needs the whole step's routing. Use schedule='gpipe'."
            )
        return self._coefficients[block]

    def step_end(self, module: Any, blocks: list[MoEFeedForward]) -> Tensor:
        """The step's balancing loss (summed over blocks and stages, the same on every rank); logs ``moe_aux_loss``,
        ``moe_dropped`` and ``moe_imbalance`` as one process does, and forgets the step's routing.

        Args:
            module: the LightningModule (for ``log``).
            blocks: this rank's MoE blocks.
        """
        first = next((b for b in blocks), None)
        device = first.router.weight.device if first is not None else torch.device("cpu")
        loss, dropped, imbalance = (torch.zeros((), device=device) for _ in range(3))
        for block in blocks:
            stats = block.pop_routing_stats()[: self.step.microbatches]  # recomputed forwards came after
            counts, tokens = self._totals.get(block) or routing_totals(stats, self.step.data_mean)
            dropped = dropped + self.step.data_sum(sum(s.dropped for s in stats))
            imbalance = torch.maximum(imbalance, counts.max() / counts.mean().clamp_min(1e-9))
            if block.aux_loss_weight:
                sums = self.step.data_mean(torch.stack([s.prob_sums.detach() for s in stats]).sum(0))
                scale = block.aux_loss_weight * balancing_factor(block.num_experts, block.top_k, tokens)
                loss = loss + scale * (counts * sums).sum()
            if block.router_kind == "sigmoid":
                block.update_expert_bias(mean=self.step.data_mean)
            block.pipelined = None
        loss, dropped = self.step.stage_sum(loss), self.step.stage_sum(dropped)
        module.log("moe_imbalance", self.step.stage_max(imbalance))
        module.log("moe_aux_loss", loss)
        module.log("moe_dropped", dropped, reduce_fx="sum")
        return loss


def pipeline_begin(model: nn.Module, step: Any) -> Optional[PipelinedBalancing]:
    """Put a fresh :class:`PipelinedBalancing` on ``model``'s MoE blocks for the step (None when it has none)."""
    blocks = moe_blocks(model)
    balancing = PipelinedBalancing(step)
    for block in blocks:
        block.pop_routing_stats()  # left by a recomputation in the last backward (activation checkpointing)
        block.pipelined = balancing
    return balancing


def schedule_refusal(moe: dict, splits: list[str]) -> Optional[str]:
    """Why ``moe``'s balancing loss cannot be exact under the pipeline split among ``splits`` (None: it can).

    Args:
        moe: the recipe's ``moe`` settings.
        splits: the suite's batch splits, e.g. ``["pipeline_parallel_size=2 (schedule='1f1b')"]``.
    """
    pipelined = [s for s in splits if s.startswith("pipeline_parallel_size")]
    if not pipelined or not moe.get("aux_loss_weight"):
        return None
    if any(f"schedule='{name}'" in pipelined[0] for name in FORWARDS_FIRST):
        return None
    return (f"moe={moe} forms its balancing loss from the routing of the whole step, but under {pipelined[0]} a "
            "micro-batch's backward runs before the step's last forward: set strategy schedule='gpipe' (exact), or "
            "aux_loss_weight=0, or pipeline_parallel_size=1.")
