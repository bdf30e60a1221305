"""A Hugging Face causal LM's loss as the token mean of the *global* batch, with no glue in the user's module.

A module whose ``training_step`` returns ``self.model(**batch).loss`` gets, from
``transformers``, the mean over *its own* valid tokens (labels not ``-100``). Under data
parallelism each rank then averages a different number of tokens, and the average of those
per-rank means is not the single-process loss whenever padding or prompt masking makes the
counts differ (2 ranks, padded batches: 4.9e-3 off one process, ranks 6.8e-2 apart).

:class:`TokenWeightedLoss` fixes this with two hooks on the model, active only while a
strategy runs a training step:

* before ``forward`` it counts the batch's valid tokens, sums the count ``N`` over the
  data-parallel ranks and passes ``num_items_in_batch = N / dp``; transformers then returns
  ``local_sum / (N / dp)``, and the data-parallel *gradient average* is exactly the gradient
  of ``sum(all token losses) / N`` -- the single-process loss;
* after ``forward`` it gives the returned loss the *value* of the global token mean (the
  mean of the per-rank values over the data-parallel ranks) while keeping the rank's own
  gradient: ``loss + (global_mean - loss).detach()``. So every rank logs, returns and shows
  the single-process number, with or without ``sync_dist``.

Under context parallelism the group is data x context and each rank holds a share of every
sequence: the count is then of the ``shift_labels`` the split batch carries (the whole
sequence's targets, already shifted), not of the share's own shifted ``labels``.

A call that already passes ``num_items_in_batch`` is left alone (the user normalises), and
so is one without ``labels`` (the user computes the loss). One scalar all-reduce before and
one after each forward of a training step is the cost.

Note:
    Exact over data-parallel ranks, not over gradient-accumulation steps: Lightning divides
    each batch's loss by ``accumulate_grad_batches``, so the batches of one optimizer step
    weigh equally, as they do in a single process with the same accumulation (parity holds);
    weighting them by token count would need every batch of the window before the first
    backward. :func:`token_weighting` warns when accumulation is on.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.adapters.hf.model import IGNORE_INDEX, causal_lm_valid_count, find_hf_model

SumOverRanks = Callable[[Tensor], Tensor]

ACCUMULATION_WARNING = (
    "accumulate_grad_batches={accumulation} with a Hugging Face causal LM: each batch's loss is the token mean over "
    "its data-parallel ranks (exact), but the {accumulation} batches of an optimizer step weigh equally, as in one "
    "process with the same accumulation -- not by their token counts. For a token mean over the whole window, raise "
    "the batch size instead of accumulating, or pass num_items_in_batch yourself "
    "(then the suite leaves the loss alone)."
)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether transformers computes ``model``'s loss with ``ForCausalLMLoss`` (shifted labels, ``-100`` ignored)."""
    return getattr(model, "loss_type", None) == "ForCausalLM"


def accepts_num_items(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``num_items_in_batch`` (by name or through ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def valid_count(labels: Tensor, shift_labels: Optional[Tensor] = None) -> Tensor:
    """Tokens carrying a loss in one forward: ``shift_labels`` not ``-100`` when given (transformers then takes
    them as the targets, unshifted: context parallelism passes each rank's share of the whole sequence's shift),
    else the shifted ``labels`` (:func:`~.hf.causal_lm_valid_count`)."""
    if shift_labels is not None:
        return (shift_labels != IGNORE_INDEX).sum()
    return causal_lm_valid_count(labels)


def group_sum(group: Optional[dist.ProcessGroup]) -> SumOverRanks:
    """An in-place sum over ``group`` (the data-parallel ranks; None: the default group)."""

    def reduce(value: Tensor) -> Tensor:
        dist.all_reduce(value, group=group)
        return value

    return reduce


class TokenWeightedLoss:
    """Hooks on a Hugging Face causal LM that make its ``.loss`` the global batch's token mean (see module docstring).

    Args:
        model: the ``transformers`` causal-LM model (``loss_type == "ForCausalLM"``).
        sum_over_ranks: sums a tensor in place over the data-parallel ranks and returns it
            (:func:`group_sum`; tests pass a stand-in).
        data_parallel_size: the number of data-parallel ranks the gradients are averaged over.
    """

    def __init__(self, model: nn.Module, sum_over_ranks: SumOverRanks, data_parallel_size: int) -> None:
        self.model = model
        self.sum_over_ranks = sum_over_ranks
        self.data_parallel_size = data_parallel_size
        self._accepts = accepts_num_items(model)
        self._injected: list[bool] = []

    @contextmanager
    def training(self) -> Iterator[None]:
        """Token-weight every forward of the model inside this block (one training step)."""
        self._injected = []
        handles = [
            self.model.register_forward_pre_hook(self._inject_count, with_kwargs=True),
            self.model.register_forward_hook(self._share_value, with_kwargs=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _inject_count(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        labels = kwargs.get("labels")
        inject = labels is not None and kwargs.get("num_items_in_batch") is None
        self._injected.append(inject)
        if not inject:
            return None
        if not self._accepts:
            raise ValueError(
                f"{type(module).__name__}.forward does not take num_items_in_batch, so its loss cannot be weighted by "
                "the valid tokens of the global batch across data-parallel ranks. Compute the loss in training_step "
                "from the logits (lightning_parallel.adapters.hf.model.causal_lm_loss_terms) instead of passing labels."
            )
        count = self.sum_over_ranks(valid_count(labels, kwargs.get("shift_labels")).to(torch.float32))
        # fp32: N / dp need not be whole, and a float64 divisor would promote the fp32 loss.
        return args, {**kwargs, "num_items_in_batch": count / self.data_parallel_size}

    def _share_value(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not (self._injected and self._injected.pop()):
            return None
        loss = output[0] if isinstance(output, tuple) else getattr(output, "loss", None)
        if loss is None:
            return None
        value = loss.detach()
        # a DTensor under loss parallelism
        value = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
        mean = self.sum_over_ranks(value) / self.data_parallel_size
        shared = loss + (mean - loss.detach())  # value: the global mean; gradient: this rank's part
        if isinstance(output, tuple):
            return (shared, *output[1:])
        output.loss = shared  # ModelOutput keeps its mapping in step with the attribute
        return output


def token_weighting(
    module: nn.Module,
    group: Optional[dist.ProcessGroup],
    data_parallel_size: int,
    accumulate_grad_batches: int = 1,
    warn: bool = True,
) -> Optional[TokenWeightedLoss]:
    """The :class:`TokenWeightedLoss` for the causal LM inside ``module``, or None when nothing needs weighting.

    None when ``module`` holds no Hugging Face causal LM or there is one data-parallel rank
    (transformers' own per-batch mean is then the batch's token mean already).

    Args:
        module: the LightningModule.
        group: the data-parallel process group (None: the default group).
        data_parallel_size: ranks in ``group``.
        accumulate_grad_batches: the Trainer's accumulation (warned about when above 1).
        warn: whether this rank prints the accumulation warning (pass ``rank == 0``).
    """
    found = find_hf_model(module)
    if found is None or data_parallel_size <= 1 or not is_causal_lm(found[1]):
        return None
    if accumulate_grad_batches > 1 and warn:
        warnings.warn(ACCUMULATION_WARNING.format(accumulation=accumulate_grad_batches), stacklevel=2)
    return TokenWeightedLoss(found[1], group_sum(group), data_parallel_size)


def training_context(weighting: Optional[TokenWeightedLoss]) -> ContextManager[None]:
    """``weighting.training()``, or a no-op without weighting."""
    return weighting.training() if weighting is not None else nullcontext()
