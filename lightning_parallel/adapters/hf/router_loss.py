"""A Hugging Face MoE model's router balancing loss over the *global* batch under data (and expert) parallelism.

With ``output_router_logits=True``, Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE add ``router_aux_loss_coef *
aux_loss`` to their loss, where ``aux_loss = E * sum_e f_e * P_e`` is formed in the model's forward from *all*
layers' router logits of the tokens it sees (transformers' ``load_balancing_loss_func``): ``f_e`` the share of
top-k assignments to expert ``e``, ``P_e`` its mean router probability, both over the valid (mask 1) token rows of
every layer. It is not a mean over tokens, so a rank's value on its part of the batch is not the one-process value.

:class:`GlobalRouterLoss` fixes it with one forward hook, active only while a strategy runs a training step. From
the returned ``router_logits`` (a public output field) and the call's ``attention_mask`` it forms this rank's
routing statistics (assignment counts, probability sums, rows), sums them over the data-parallel ranks (one
all-reduce of ``2E + 1`` numbers), and replaces the local term in ``loss`` (and ``aux_loss``) by the global one:

* value: ``E * sum_e (C_e / R) (S_e / R)`` with ``C, S, R`` summed over the ranks -- the one-process value;
* gradient: the counts carry none (top-k), and ``P_e = (1/R) sum_r S_{r,e}``, so the rank's term is
  ``D * E * sum_e (C_e / R) (S_{r,e} / R)``, whose gradients averaged over the ``D`` ranks are the global loss's.

It runs before :class:`~.hf_loss.TokenWeightedLoss`'s hook, which then averages a value already equal on every
rank. Pipeline and context splits stay refused (stages drop the term; a context share's mask is a descriptor).

Note:
    transformers offers no hook into the balancing loss itself (a module-level function called by name inside
    ``forward``), so the suite recomputes the model's local term with the same formula and checks it against the
    returned ``aux_loss`` at every step: a family whose formula differs is stopped with a message, never trained
    on a silently different objective.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.adapters.hf.experts import CHECKED_FAMILIES
from lightning_parallel.adapters.hf.loss import SumOverRanks, is_causal_lm
from lightning_parallel.parallel.pipeline.step_hooks import FORWARDS_FIRST

CONSISTENCY = 1e-5  # relative: the suite's local term against the model's returned aux_loss


def has_router_loss(model: nn.Module) -> bool:
    """Whether ``model`` adds its router's balancing loss to its loss (``output_router_logits=True``)."""
    return bool(getattr(getattr(model, "config", None), "output_router_logits", False))


def can_globalise(model: nn.Module) -> bool:
    """Whether :class:`GlobalRouterLoss` knows ``model``'s balancing loss (a checked family's causal LM, whose
    loss the strategies weight through :meth:`~.hugging_face.HuggingFaceAdapter.loss_weighting`)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    return family in CHECKED_FAMILIES and is_causal_lm(model) and all(
        hasattr(model, name) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef"))


def routing_statistics(router_logits: tuple[Tensor, ...], num_experts: int, top_k: int,
                       attention_mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(counts [E], probability sums [E], rows)`` of the layers' routing, as transformers sums them.

    Args:
        router_logits: one ``[tokens, E]`` tensor per MoE layer.
        num_experts: ``E``.
        top_k: experts per token.
        attention_mask: ``[batch, seq]`` (1: a valid token), or None (every row counts).
    """
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        weights = torch.softmax(logits.to(device), dim=-1)
        selected = torch.topk(weights, top_k, dim=-1).indices
        mask = (attention_mask.reshape(-1).to(device=device, dtype=torch.float32) if attention_mask is not None
                else torch.ones(weights.shape[0], dtype=torch.float32, device=device))
        counts = counts.scatter_add(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(0)
        rows = rows + mask.sum()
    return counts, probs, rows


class GlobalRouterLoss:
    """A forward hook that makes a Hugging Face MoE model's balancing term the global batch's (module docstring).

    Args:
        model: the ``transformers`` MoE causal LM (:func:`can_globalise`).
        sum_over_ranks: sums a tensor in place over the data-parallel ranks and returns it (``hf_loss.group_sum``).
        data_parallel_size: the ranks the gradients are averaged over.
    """

    def __init__(self, model: nn.Module, sum_over_ranks: SumOverRanks, data_parallel_size: int) -> None:
        self.model, self.sum_over_ranks, self.data_parallel_size = model, sum_over_ranks, data_parallel_size

    @contextmanager
    def training(self) -> Iterator[None]:
        """Replace the balancing term of every forward of the model inside this block (one training step)."""
        handle = self.model.register_forward_hook(self._globalise, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _globalise(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        logits, aux, loss = (getattr(output, name, None) for name in ("router_logits", "aux_loss", "loss"))
        if not logits or not isinstance(aux, Tensor) or loss is None:
            return None  # no balancing term in this call (no labels, or router logits not returned)
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"{type(module).__name__}'s router balancing loss under data parallelism needs a "
                             f"[batch, seq] attention_mask, got {tuple(mask.shape)}: pass the 2-D padding mask.")
        experts, coef = int(module.num_experts), float(module.router_aux_loss_coef)
        counts, probs, rows = routing_statistics(logits, experts, int(module.num_experts_per_tok), mask)
        self._check_local(module, aux, experts * torch.sum(counts / rows * (probs.detach() / rows)))
        total = self.sum_over_ranks(torch.cat([counts, probs.detach(), rows.view(1)]))
        share, global_probs, global_rows = total[:experts] / total[-1], total[experts:-1], total[-1]
        value = experts * torch.sum(share * global_probs / global_rows)
        term = self.data_parallel_size * experts * torch.sum(share * probs / global_rows)
        term = term + (value - term).detach()  # value: the global term; gradient: this rank's part of it
        output.loss = loss - coef * aux.to(loss.device) + coef * term.to(loss.device)
        output.aux_loss = term
        return output

    @staticmethod
    def _check_local(module: nn.Module, aux: Tensor, local: Tensor) -> None:
        expected, got = float(aux.detach()), float(local)
        if abs(expected - got) > CONSISTENCY * max(1.0, abs(expected)):
            raise ValueError(
                f"{type(module).__name__}'s router balancing loss ({expected:.6g}) is not the formula the suite makes "
                f"global ({got:.6g}): its family forms it differently. Set output_router_logits=False, or split the "
                "batch only by tensor parallelism."
            )


class CombinedWeighting:
    """Several loss weightings entered in order, so their hooks run in that order (the router term first).

    Args:
        weightings: objects with a ``training()`` context manager.
    """

    def __init__(self, *weightings: Any) -> None:
        self.weightings = weightings

    @contextmanager
    def training(self) -> Iterator[None]:
        """Every weighting's ``training()`` at once."""
        with ExitStack() as stack:
            for weighting in self.weightings:
                stack.enter_context(weighting.training())
            yield


#: Splits under which the balancing term cannot be made global: a pipeline schedule that runs a backward before the
#: step's last forward (under ``gpipe`` :mod:`.hf_router_pipeline` makes it exact), and a context share, whose
#: attention mask is a descriptor, not the tokens' padding mask.
UNSUPPORTED_SPLITS = ("pipeline_parallel_size", "context_parallel_size")


def _forwards_first(split: str) -> bool:
    return split.startswith("pipeline_parallel_size") and any(f"schedule='{name}'" in split for name in FORWARDS_FIRST)


def check_router_loss_split(model: nn.Module, splits: list[str]) -> None:
    """Refuse, before start, a balancing loss a split batch would change: any split of a family the suite cannot
    make global, and pipeline or context splits of any family; data (and expert) splits of the checked families
    are made exact by :class:`GlobalRouterLoss`.

    Args:
        model: the ``transformers`` model.
        splits: how the layout splits each batch, as settings (``["data_parallel_size=2"]``); empty: whole.
    """
    if not splits or not has_router_loss(model):
        return
    refused = [split for split in splits if split.startswith(UNSUPPORTED_SPLITS) and not _forwards_first(split)]
    if refused or not can_globalise(model):
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        why = (f"{', '.join(refused)} would form it per part of each batch (a pipeline schedule other than 'gpipe' "
               "runs a backward before the step's routing is known)" if refused
               else f"{', '.join(splits)} would form it per part of each batch ({family}'s is not one the suite "
               f"makes global: {', '.join(CHECKED_FAMILIES.values())})")
        raise ValueError(
            f"{type(model).__name__} adds its router's load-balancing loss (output_router_logits=True), which is "
            f"formed from the routing statistics of the tokens it sees: {why}, a different objective from one "
            "process's. Set output_router_logits=False in the model config, split the batch only by data, expert and "
            "pipeline parallelism with schedule='gpipe' (a checked family's term is then summed over the ranks), or "
            "only by tensor parallelism "
            "(tensor_parallel_size), which keeps every token on every rank."
        )


def with_router_loss(model: nn.Module, weighting: Any, sum_over_ranks: SumOverRanks, data_parallel_size: int) -> Any:
    """``weighting`` preceded by :class:`GlobalRouterLoss` when ``model`` returns a balancing loss, else itself.

    Args:
        model: the ``transformers`` model.
        weighting: the token weighting of its causal-LM loss (:class:`~.hf_loss.TokenWeightedLoss`).
        sum_over_ranks: sums a tensor in place over the data-parallel ranks.
        data_parallel_size: the ranks the gradients are averaged over.
    """
    if not has_router_loss(model):
        return weighting
    return CombinedWeighting(GlobalRouterLoss(model, sum_over_ranks, data_parallel_size), weighting)
