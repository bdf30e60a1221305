"""A mixture-of-experts feed-forward block for the GPT recipe (``model=gpt_moe``); it runs alone on one process.

Note:
    Conventions (each the one a named model uses):

    * Router ``nn.Linear(d_model, num_experts, bias=False)``. ``"softmax"`` is Mixtral's: softmax over all
      experts, top-k, and the k weights renormalised to sum to 1. ``"sigmoid"`` is DeepSeek-V3's (torchtitan's
      auxiliary-loss-free balancing): sigmoid scores, the k experts chosen on ``score + expert_bias`` (a buffer,
      not learned, used for the choice only), the weights the chosen scores *without* the bias, renormalised.
    * Experts are GELU MLPs like the dense :class:`examples.transformer.MLP`, without biases, held as grouped
      weights ``w_up [E, d, h]`` and ``w_down [E, h, d]`` and run over the token copies sorted by expert with a
      grouped matrix multiply (:func:`loop_grouped_mm`, a loop over experts, here).
    * Dropless by default. With ``capacity_factor=c`` an expert takes at most ``ceil(c * T * k / E)`` copies of
      the ``T`` tokens of one forward; the copies over it are dropped, those of the lowest token indices kept,
      and counted: ``dropped`` counts (token, expert) assignments, so a token can lose one of its k experts.
    * The balancing loss is Switch/GShard's as Megatron writes it: ``E * sum_e f_e * P_e`` with
      ``f_e = C_e / (k T)`` (share of the routed copies, before any dropping) and ``P_e = S_e / T`` (mean router
      probability; for the sigmoid router, the scores normalised per token). Uniform routing gives 1.

    The global balancing loss. One step's global batch has ``T`` tokens spread over micro-batches and ``D``
    data ranks (expert-parallel ranks hold different tokens, so they count among the ``D``). Rank ``r`` holds
    ``c_e^r`` routed copies and ``s_e^r`` summed probabilities per expert, over its micro-batches; every
    forward records them as a :class:`RoutingStats`. With ``C = sum_r c^r``, ``S = sum_r s^r``::

        aux = E / (k T^2) * sum_e C_e S_e

    ``C`` and ``T`` come from a top-k and carry no gradient, so ``grad aux = sum_r grad[E/(k T^2) sum_e C_e s_e^r]``:
    the counts must be global, the probability sums may stay local. The suite *averages* gradients over the
    ``D`` ranks, so rank ``r`` contributes ``l_r = D * E/(k T^2) * sum_e C_e s_e^r`` and
    ``(1/D) sum_r grad l_r = grad aux``. Written with means over ranks (``Cm = C/D``, ``Tm = T/D``)::

        l_r = E / (k Tm^2) * sum_e Cm_e s_e^r

    which needs no ``D``, and stays right when ranks holding the same tokens (tensor peers) join the mean; the
    mean of ``l_r`` over ranks is ``aux``. :func:`balancing_loss` returns ``l_r + (aux - l_r).detach()``: the
    value ``aux`` on every rank, the gradient ``l_r``'s. ``l_r`` is linear in ``s^r``, so micro-batches add
    up, but ``C`` and ``T`` are the whole step's: the stats of every micro-batch are summed before the loss is
    formed (a schedule that runs a backward before the step's last forward cannot be exact).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Linear = Callable[..., nn.Module]  # (in_features, out_features, bias=...) -> a Linear
Mean = Callable[[Tensor], Tensor]  # a tensor's mean over the ranks (see balancing_loss)
ROUTERS = ("softmax", "sigmoid")


@dataclass
class RoutingStats:
    """What one forward of an MoE block routed, for the balancing loss and logging.

    Args:
        counts: ``[E]`` token copies routed to each expert, before any dropping (no gradient).
        prob_sums: ``[E]`` router probabilities summed over the tokens (carries the router's gradient).
        tokens: the number of tokens (a 0-d float tensor, so that stats reduce as one tensor).
        dropped: token copies over capacity (0-d float tensor).
    """

    counts: Tensor
    prob_sums: Tensor
    tokens: Tensor
    dropped: Tensor


def loop_grouped_mm(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """``x[rows of group g] @ weight[g]`` for consecutive row groups: the reference grouped matrix multiply.

    Args:
        x: ``[m, k]`` rows sorted by group.
        weight: ``[G, k, n]``.
        counts: ``[G]`` rows per group (summing to ``m``).
    """
    pieces = x.split(counts.tolist())
    if not pieces:
        return x.new_zeros(0, weight.shape[-1])
    return torch.cat([piece @ weight[g] for g, piece in enumerate(pieces)])


GroupedMM = Callable[[Tensor, Tensor, Tensor], Tensor]


class GroupedExperts(nn.Module):
    """``E`` GELU MLPs held as grouped weights ``w_up [E, d, h]``, ``w_down [E, h, d]``, each N(0, ``std``).

    Expert parallelism replaces this module by one with the same attributes holding a slice of the experts;
    :meth:`keep` and :meth:`forward` are what the block calls.

    Args:
        num_experts: ``E``.
        d_model: token width.
        hidden: hidden width of one expert.
        std: standard deviation of both weights.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, std: float = 0.02) -> None:
        super().__init__()
        self.num_experts, self.std = num_experts, std
        self.w_up = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.w_up, self.w_down):
            nn.init.normal_(weight, mean=0.0, std=self.std)

    @staticmethod
    def expert_mlp(x: Tensor, counts: Tensor, w_up: Tensor, w_down: Tensor, mm: GroupedMM = loop_grouped_mm) -> Tensor:
        """The experts' math on rows sorted by expert (``counts[g]`` rows for ``w_up[g]``): ``gelu(x W_up) W_down``.

        Args:
            x: ``[m, d]`` rows sorted by expert.
            counts: ``[G]`` rows per expert of these weights.
            w_up: ``[G, d, h]``.
            w_down: ``[G, h, d]``.
            mm: the grouped matrix multiply.
        """
        return mm(F.gelu(mm(x, w_up, counts)), w_down, counts)

    def keep(self, counts: Tensor, tokens: int, capacity: Callable[[int], int]) -> Tensor:
        """Copies kept per expert: the first ``capacity(tokens)`` of each (this forward is the whole batch).

        Args:
            counts: ``[E]`` copies routed to each expert.
            tokens: tokens of this forward.
            capacity: the block's capacity of one expert for a batch of that many tokens.
        """
        return counts.clamp(max=capacity(tokens))

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        return self.expert_mlp(x, counts, self.w_up, self.w_down)


class MoEFeedForward(nn.Module):
    """Top-k routed experts in place of the dense MLP: ``[..., d] -> [..., d]`` (see the module's Note).

    Every forward in training records a :class:`RoutingStats` in ``routing_stats`` (taken by
    :meth:`pop_routing_stats`) and adds its counts to ``routed_counts`` (read by :meth:`update_expert_bias`);
    ``dropped_tokens`` holds the last forward's dropped copies.

    Args:
        d_model: token width.
        hidden: hidden width of one expert.
        num_experts: ``E``.
        top_k: experts per token.
        router: ``"softmax"`` (Mixtral) or ``"sigmoid"`` (DeepSeek-V3, with the expert bias).
        capacity_factor: None for dropless; else ``c > 0``, the capacity ``ceil(c * T * k / E)`` copies.
        aux_loss_weight: weight of the balancing loss (:func:`model_balancing_loss`); 0 leaves it out.
        bias_update_rate: step of the sigmoid router's bias update (:meth:`update_expert_bias`).
        normalize_weights: renormalise the k weights to sum to 1 (Mixtral, DeepSeek-V3); False keeps the raw
            probabilities (Switch's top-1, where a renormalised weight would be 1 and the router get no gradient).
        dropout: dropout on the output.
        linear: makes the router (``nn.Linear``; called with ``bias=False``).
        std: standard deviation of the experts' weights.
    """

    def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int = 2, router: str = "softmax",
                 capacity_factor: Optional[float] = None, aux_loss_weight: float = 0.0,
                 bias_update_rate: float = 1e-3, normalize_weights: bool = True, dropout: float = 0.0,
                 linear: Linear = nn.Linear, std: float = 0.02) -> None:
        super().__init__()
        _check(num_experts, top_k, router, capacity_factor)
        self.num_experts, self.top_k, self.router_kind = num_experts, top_k, router
        self.capacity_factor, self.aux_loss_weight = capacity_factor, aux_loss_weight
        self.bias_update_rate, self.normalize_weights = bias_update_rate, normalize_weights
        self.router = linear(d_model, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, d_model, hidden, std)
        self.drop = nn.Dropout(dropout)
        if router == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        # Not persistent: a count of the current step, not a weight.
        self.register_buffer("routed_counts", torch.zeros(num_experts), persistent=False)
        self.routing_stats: list[RoutingStats] = []
        self.dropped_tokens = torch.zeros(())
        self.pipelined = None  # a PipelinedBalancing while a pipeline schedule trains the block

    def reset_parameters(self) -> None:
        """Zero the expert bias and the step's counts (the router and experts initialise themselves)."""
        for name in ("expert_bias", "routed_counts"):
            if hasattr(self, name):
                getattr(self, name).zero_()

    def capacity(self, tokens: int) -> int:
        """Copies one expert takes from a batch of ``tokens`` tokens: ``ceil(c * tokens * k / E)``.

        Args:
            tokens: tokens of the batch the capacity is shared over.
        """
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(expert ids [T, k], weights [T, k], probabilities [T, E] for the balancing loss)`` of tokens ``x``.

        Args:
            x: ``[T, d]`` tokens.
        """
        logits = self.router(x)
        if self.router_kind == "softmax":
            probs = logits.softmax(-1)
            weights, ids = probs.topk(self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices  # the bias picks, never weighs
            weights = scores.gather(-1, ids)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.normalize_weights:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights, probs

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        tokens = flat.shape[0]
        ids, weights, probs = self.route(flat)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        kept = counts if self.capacity_factor is None else self.experts.keep(counts, tokens, self.capacity)
        copies = kept_copies(ids.flatten(), counts, kept)
        token_of = copies // self.top_k
        rows = self.experts(flat[token_of], kept)
        # Under autocast the experts' matmuls give bf16 rows while the (normed) input stays fp32: combine in the
        # input's dtype, as the residual stream carries it.
        weighted = (rows * weights.flatten()[copies, None].to(rows.dtype)).to(flat.dtype)
        out = torch.zeros_like(flat).index_add(0, token_of, weighted)
        self._record(counts, probs, tokens, (counts - kept).sum())
        out = self.drop(out).reshape(x.shape)
        if self.training and self.pipelined is not None:  # under a pipeline schedule (examples/nlp/moe_pipeline.py)
            out = self.pipelined.attach(self, out)
        return out

    def _record(self, counts: Tensor, probs: Tensor, tokens: int, dropped: Tensor) -> None:
        self.dropped_tokens = dropped.detach()
        if not self.training:
            return
        counts = counts.detach().float()
        self.routed_counts += counts
        self.routing_stats.append(RoutingStats(counts, probs.float().sum(0), counts.new_tensor(float(tokens)),
                                               self.dropped_tokens.float()))

    def forget_last_forward(self) -> None:
        """Undo the last training forward's record (a forward that was not one of the step's micro-batches)."""
        if self.routing_stats:
            self.routed_counts -= self.routing_stats.pop().counts

    def pop_routing_stats(self) -> list[RoutingStats]:
        """The stats recorded since the last call (one per training forward), and forget them.

        Note:
            A forward that activation checkpointing recomputes in the backward records again: take the stats
            when the loss is formed and call this once more before the next step's first forward.
        """
        stats, self.routing_stats = self.routing_stats, []
        return stats

    @torch.no_grad()
    def update_expert_bias(self, mean: Optional[Mean] = None) -> None:
        """The sigmoid router's auxiliary-loss-free balancing, called after each optimizer step (torchtitan's rule).

        ``bias += rate * sign(mean(n) - n)``, centred to mean zero, where ``n`` is the step's routed copies per
        expert (``routed_counts``, reset here): under-loaded experts become more likely to be chosen. Only the
        sign of ``mean(n) - n`` matters, so the mean over ranks gives the global update, the same on every rank.

        Args:
            mean: the mean of a tensor over the data ranks (None on one process).
        """
        if self.router_kind != "sigmoid":
            raise ValueError("update_expert_bias() is for router='sigmoid': the softmax router has no expert bias.")
        counts = self.routed_counts if mean is None else mean(self.routed_counts.clone())
        delta = self.bias_update_rate * torch.sign(counts.mean() - counts)
        self.expert_bias += delta - delta.mean()
        self.routed_counts.zero_()


def _check(num_experts: int, top_k: int, router: str, capacity_factor: Optional[float]) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]: lower top_k or add experts.")
    if router not in ROUTERS:
        raise ValueError(f"router={router!r} is not one of {ROUTERS}: pick one of them.")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0: pass None for dropless routing.")


def kept_copies(expert_ids: Tensor, counts: Tensor, kept: Tensor) -> Tensor:
    """Indices of the token copies that run, sorted by (expert, token): the first ``kept[e]`` of each expert.

    Args:
        expert_ids: ``[T * k]`` the expert of each copy, token-major (copy ``j`` is token ``j // k``).
        counts: ``[E]`` copies per expert.
        kept: ``[E]`` copies kept per expert (``counts`` when dropless).
    """
    order = torch.argsort(expert_ids, stable=True)  # stable: by token index within an expert
    if kept is counts:
        return order
    expert = expert_ids[order]
    position = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[expert]
    return order[position < kept[expert]]


def balancing_loss(stats: list[RoutingStats], top_k: int, mean: Optional[Mean] = None) -> Tensor:
    """This rank's term of one layer's global balancing loss: value ``aux`` everywhere, exact gradient share.

    Args:
        stats: the layer's stats of every forward of the step on this rank (micro-batches included).
        top_k: the layer's experts per token.
        mean: ``mean(t)``, the mean of ``t`` over ranks among which every token of the global batch is held by
            the same number of ranks (the data ranks, expert-parallel ones included; tensor peers may join);
            the same count on every rank is divided by ``mean``'s ranks as data parallelism divides gradients.
            None on one process.
    """
    if not stats:
        raise ValueError("balancing_loss() got no routing stats: run a training forward (model.train()) first.")
    counts, tokens = routing_totals(stats, mean)
    local = torch.stack([s.prob_sums for s in stats]).sum(0)
    term = balancing_factor(counts.numel(), top_k, tokens) * (counts * local).sum()
    value = term.detach() if mean is None else mean(term.detach().clone())
    return term + (value - term.detach())


def routing_totals(stats: list[RoutingStats], mean: Optional[Mean] = None) -> tuple[Tensor, Tensor]:
    """``(copies per expert [E], tokens)`` of a step's stats, meaned over the ranks by ``mean`` (one collective of
    ``E + 1`` numbers; no gradient).

    Args:
        stats: one layer's stats of every forward of the step on this rank.
        mean: see :func:`balancing_loss`; None on one process.
    """
    counts = torch.stack([s.counts for s in stats]).sum(0)
    packed = torch.cat([counts, sum(s.tokens for s in stats).reshape(1)])
    if mean is not None:
        packed = mean(packed)
    return packed[:-1], packed[-1]


def balancing_factor(num_experts: int, top_k: int, tokens: Tensor) -> Tensor:
    """``E / (k T^2)``: the balancing loss is this times ``sum_e C_e S_e`` (the module's Note).

    Args:
        num_experts: ``E``.
        top_k: ``k``.
        tokens: ``T`` (meaned over ranks, as the counts).
    """
    return num_experts / (top_k * tokens * tokens)


def moe_blocks(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE blocks of ``model``, in module order.

    Args:
        model: any module.
    """
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def model_balancing_loss(model: nn.Module, mean: Optional[Mean] = None) -> tuple[Tensor, Tensor]:
    """``(sum over MoE blocks of aux_loss_weight * balancing loss, this rank's dropped copies)``; takes the stats.

    Args:
        model: the model holding the blocks (their stats are popped).
        mean: see :func:`balancing_loss`.
    """
    loss, dropped = torch.zeros(()), torch.zeros(())
    for block in moe_blocks(model):
        stats = block.pop_routing_stats()
        dropped = dropped + sum((s.dropped for s in stats), torch.zeros(()))
        if block.aux_loss_weight and stats:
            loss = loss + block.aux_loss_weight * balancing_loss(stats, block.top_k, mean)
    return loss, dropped


def moe_settings(moe: dict, n_layer: int) -> tuple[set[int], dict]:
    """``(indices of the MoE blocks, MoEFeedForward keyword arguments)`` of the GPT recipe's ``moe`` setting.

    Block ``i`` is MoE when ``(i + 1) % every == 0`` (torchtitan's interleave step; ``every=1``: all blocks).

    Args:
        moe: ``every`` plus :class:`MoEFeedForward`'s keyword arguments (``num_experts`` required; ``hidden``
            defaults to the dense MLP's width).
        n_layer: the model's blocks.
    """
    settings = dict(moe)
    every = int(settings.pop("every", 1))
    allowed = set(inspect.signature(MoEFeedForward).parameters)
    unknown = set(settings) - (allowed - {"d_model", "dropout", "linear"})
    if unknown or "num_experts" not in settings:
        raise ValueError(f"moe={moe}: unknown keys {sorted(unknown)} or no num_experts; give num_experts and any of "
                         f"every, {sorted(allowed - {'d_model', 'dropout', 'linear', 'num_experts'})}.")
    if every < 1:
        raise ValueError(f"moe every={every} must be >= 1: 1 makes every block MoE, 2 every second one.")
    return {i for i in range(n_layer) if (i + 1) % every == 0}, settings
