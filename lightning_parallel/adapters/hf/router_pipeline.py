"""A Hugging Face MoE model's router balancing loss through a pipeline schedule (``output_router_logits=True``).

transformers forms ``aux = E * sum_e (C_e / R) (S_e / R)`` in the model's ``forward`` from every MoE layer's router
logits (:mod:`.hf_router_loss`: ``C`` top-k assignments, ``S`` router probabilities and ``R`` rows, each summed over
the valid tokens of *all* layers). A pipeline schedule never calls that ``forward``: each rank runs its stage's
layers per micro-batch. :class:`PipelinedRouterLoss` gives the same objective over the global batch:

* at every micro-batch forward of a router (``<sparse block>.gate``, returning ``(logits, scores, indices)``) it
  adds the layer's ``C``, ``S`` and ``R`` (under the micro-batch's 2-D ``attention_mask``) to this rank's sums;
* once this rank's routers have run every micro-batch, it starts a sum of ``C`` and ``R`` over every rank holding
  other tokens or other layers (the world; tensor peers hold the same and are divided out): non-blocking, since
  each stage gets there at its own time;
* in the backward, the sparse block's output carries the loss's gradient for the layer's logits: ``C`` and ``R``
  carry none, so per unit of this rank's probability sums it is ``coef * D * E * C_e / R^2`` (``D`` data x context
  ranks, whose gradients the strategy averages), pushed through the softmax of the saved logits;
* after the schedule, ``S`` is summed likewise and ``coef * aux`` is added to the step's loss on every rank.

The gradient needs the whole step's routing before any backward: schedules ``gpipe`` and ``looped_bfs`` only
(:data:`~lightning_parallel.parallel.pipeline.step_hooks.FORWARDS_FIRST`); the others are refused before start. A
forward torch runs to infer stage shapes is not counted (:mod:`~lightning_parallel.parallel.pipeline.microbatch_stage`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.adapters.hf.router_loss import routing_statistics


class _RouterGradient(torch.autograd.Function):
    """Identity on a sparse block's output; in the backward, the balancing loss's gradient for the block's router
    logits (their coefficient is known only once the step's forwards are done)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, logits: Tensor, mask: Tensor, loss: "PipelinedRouterLoss") -> Tensor:
        # Kept on ctx, not saved for backward: under activation checkpointing the recomputation (which does not
        # pass through here) must save the same tensors as the forward did.
        ctx.logits, ctx.mask, ctx.loss = logits.detach(), mask, loss
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        logits, mask = ctx.logits, ctx.mask
        coefficient = ctx.loss.coefficient()
        probs = torch.softmax(logits.float(), dim=-1)
        # d/dlogits of sum_e g_e * sum_t mask_t * softmax(logits_t)_e
        extra = mask[:, None] * probs * (coefficient - (probs * coefficient).sum(-1, keepdim=True))
        return grad, extra.to(logits.dtype), None, None


def sparse_blocks(module: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(sparse block, its router)`` of every MoE layer in ``module``: the modules holding an ``experts`` module
    (the ``ep_plan``'s dispatch style) and its ``gate`` router, as every family of ``hf_experts.CHECKED_FAMILIES``
    builds them."""
    return [(block, block.gate) for block in module.modules()
            if isinstance(getattr(block, "experts", None), nn.Module) and isinstance(getattr(block, "gate", None),
                                                                                      nn.Module)]


class PipelinedRouterLoss:
    """The router balancing loss of one rank's stages under a pipeline schedule (see the module docstring).

    Args:
        model: the ``transformers`` MoE causal LM (its config: experts, top-k, ``router_aux_loss_coef``).
        stages: this rank's stage modules (their ``attention_mask`` keyword is each micro-batch's mask).
        tensor_parallel_size: tensor peers, which hold the same tokens and layers (divided out of the sums).
    """

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module], tensor_parallel_size: int) -> None:
        self.experts, self.top_k = int(model.num_experts), int(model.num_experts_per_tok)
        self.coef, self.tensor_size = float(model.router_aux_loss_coef), tensor_parallel_size
        self.blocks = [pair for stage in stages for pair in sparse_blocks(stage)]
        self._block_of = {router: block for block, router in self.blocks}
        self.step: Optional[Any] = None
        self._mask: Optional[Tensor] = None
        self._logits: dict[nn.Module, tuple[Tensor, Tensor]] = {}
        for stage in stages:
            stage.register_forward_pre_hook(self._take_mask, with_kwargs=True)
        for block, router in self.blocks:
            router.register_forward_hook(self._routed)
            block.register_forward_hook(self._carry)

    def begin(self, step: Any) -> None:
        """Start a training step (:class:`~lightning_parallel.parallel.pipeline.step_hooks.PipelineStep`)."""
        self.step, self._forwards, self._work, self._coefficient = step, 0, None, None
        device = self.blocks[0][1].weight.device if self.blocks else torch.device("cpu")
        self._sums = torch.zeros(2 * self.experts + 1, device=device)  # C, S (detached), R
        if not self.blocks:  # a stage without MoE layers still joins the sums
            self._start_sum()

    def _take_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._mask = kwargs.get("attention_mask")

    def _routed(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.step is None or not module.training or not self.step.in_microbatch_forward():
            return
        logits = output[0] if isinstance(output, tuple) else output
        mask = (self._mask.reshape(-1).float() if self._mask is not None
                else torch.ones(logits.shape[0], device=logits.device))
        counts, probs, rows = routing_statistics((logits.detach(),), self.experts, self.top_k, self._mask)
        self._sums += torch.cat([counts, probs, rows.view(1)])
        self._logits[self._block_of[module]] = (logits, mask.to(logits.device))
        self._forwards += 1
        if self._forwards == self.step.microbatches * len(self.blocks):
            self._start_sum()

    def _carry(self, module: nn.Module, args: tuple, output: Any) -> Any:
        taken = self._logits.pop(module, None)
        if taken is None:
            return None
        if isinstance(output, tuple):
            return (_RouterGradient.apply(output[0], *taken, self), *output[1:])
        return _RouterGradient.apply(output, *taken, self)

    def _start_sum(self) -> None:
        self._counts_rows = torch.cat([self._sums[: self.experts], self._sums[-1:]])
        self._work = dist.all_reduce(self._counts_rows, async_op=True)

    def _totals(self) -> tuple[Tensor, Tensor]:
        if self._work is None:
            raise RuntimeError(
                f"A backward of the pipeline schedule {self.step.schedule!r} reached an MoE layer before the step's "
                "last forward: its router balancing loss needs the whole step's routing. Use schedule='gpipe'.")
        self._work.wait()
        totals = self._counts_rows / self.tensor_size
        return totals[:-1], totals[-1]

    def coefficient(self) -> Tensor:
        """``coef * D * E * C / R^2`` (times the schedule's loss scale): the gradient per unit of probability sum."""
        if self._coefficient is None:
            counts, rows = self._totals()
            scale = self.coef * self.step.data_size * self.experts * self.step.loss_scale
            self._coefficient = scale * counts / (rows * rows)
        return self._coefficient

    def end(self, step: Any) -> Tensor:
        """The step's ``coef * aux`` over the global batch, the same on every rank (added to the step's loss)."""
        counts, rows = self._totals()
        probs = self._sums[self.experts: 2 * self.experts].clone()
        dist.all_reduce(probs)
        value = self.coef * self.experts * torch.sum(counts / rows * (probs / self.tensor_size) / rows)
        self.step, self._logits = None, {}
        return value
