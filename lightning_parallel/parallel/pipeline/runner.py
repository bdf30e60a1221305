"""One call per batch: run this rank's pipeline stages under a schedule and agree on the loss.

The loss of one micro-batch comes from the module in one of two forms:

* a *mean* (``pipeline_loss``): each micro-batch loss is divided by the micro-batch count,
  so the accumulated gradients are those of the batch's mean -- right when every item
  weighs the same;
* *terms* ``(loss_sum, num_items)`` (``pipeline_loss_terms``, the Hugging Face causal-LM
  loss): each micro-batch's ``loss_sum`` is divided by the batch's item count, so the
  gradients and the loss are ``sum(token losses) / sum(valid tokens)`` over all
  micro-batches and data-parallel ranks -- the single-process loss with padding and
  ``-100`` labels, where the mean of per-micro-batch means is not.

Note:
    torch's ``scale_grads=True`` would divide the whole ``.grad`` by the micro-batch count
    after the step -- including gradients accumulated from earlier batches
    (``accumulate_grad_batches``), which must not be rescaled. The scaling is done on each
    micro-batch loss instead (``scale_grads=False``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, check_microbatches

LossFn = Callable[[Any, Any], Union[Tensor, tuple[Tensor, Tensor]]]


def first_tensor(value: Any) -> Tensor:
    """The first tensor in a (nested) batch structure: it gives the batch size and the device."""
    if isinstance(value, Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        try:
            return first_tensor(item)
        except ValueError:
            continue
    raise ValueError(f"The batch's model inputs hold no tensor (got {type(value).__name__}).")


def default_item_count(targets: Tensor) -> Tensor:
    """Items carrying a loss: integer targets other than ``-100``; every entry of float targets."""
    return torch.tensor(targets.numel()) if targets.is_floating_point() else (targets != -100).sum()


class PipelineRunner:
    """Runs one pipeline schedule over this rank's stages, and agrees on the loss.

    Args:
        stages: this rank's stage modules (in stage order); each may offer
            ``stage_arguments(inputs) -> (args, kwargs)`` and ``tied`` copies to keep in step.
        stage_ids: their stage indices.
        num_stages: total stages.
        schedule: a key of :data:`~lightning_parallel.parallel.pipeline.schedules.SCHEDULES`.
        microbatches: micro-batches per batch.
        loss_fn: ``(output, target) -> mean loss`` or ``-> (loss_sum, num_items)`` of one micro-batch.
        device: where the stages run.
        group: the pipeline process group.
        last_stage_rank: global rank of the process holding the last stage (in ``group``).
        data_parallel_size: data-parallel replicas whose gradients are averaged after the
            step; with loss terms each rank divides by ``num_items / data_parallel_size``
            so that the average is the global token-weighted mean.
        count_items: ``targets -> items carrying a loss`` when ``num_items`` is not given.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
        device: torch.device,
        group: dist.ProcessGroup,
        last_stage_rank: int,
        data_parallel_size: int = 1,
        count_items: Optional[Callable[[Any], Tensor]] = None,
    ) -> None:
        from torch.distributed.pipelining import schedules

        from lightning_parallel.parallel.pipeline.microbatch_stage import MicrobatchStage

        self.microbatches, self.data_parallel_size = microbatches, data_parallel_size
        self.group, self.last_stage_rank = group, last_stage_rank
        self.modules, self.loss_scale, self.count_items = list(stages), 1.0, count_items or default_item_count
        self._predicting, self._user_loss = False, loss_fn
        self.stages = [MicrobatchStage(mod, idx, num_stages, device, group=group)
                       for mod, idx in zip(stages, stage_ids)]
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        self.tied = [entry for mod in stages for entry in getattr(mod, "tied", ())]
        cls = getattr(schedules, SCHEDULES[schedule][0])
        single = SCHEDULES[schedule][1] == "one"
        self.schedule = cls(
            self.stages[0] if single else self.stages,
            n_microbatches=microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self._batch_size: Optional[int] = None
        self._divisor: Optional[Tensor] = None  # items each rank divides its loss sum by (terms only)
        self.microbatch_scale = 1.0 / microbatches  # what each mean loss is multiplied by
        self._terms = False  # whether the last micro-batch losses came as (sum, count) terms

    def in_microbatch_forward(self) -> bool:
        """Whether one of this rank's stages is running a micro-batch forward of the schedule (not torch's
        shape-inference forward: :mod:`.microbatch_stage`)."""
        return any(stage.in_microbatch_forward for stage in self.stages)

    def _loss(self, output: Any, target: Any) -> Tensor:
        if self._predicting:  # torch computes a loss whenever a loss_fn is set; predict has no targets
            return torch.zeros((), device=first_tensor(output).device)
        value = self._user_loss(output, target)
        # loss_scale carries 1/accumulate_grad_batches, as Lightning scales a closure loss.
        self._terms = isinstance(value, tuple)
        if self._terms:
            loss_sum, _ = value
            return loss_sum * (self.loss_scale / self._divisor.to(loss_sum.device))
        return value * (self.loss_scale * self.microbatch_scale)

    def _check_batch(self, inputs: Any) -> Tensor:
        sample = first_tensor(inputs)
        size = int(sample.shape[0])
        check_microbatches(size, self.microbatches)
        if self._batch_size not in (None, size):
            raise ValueError(
                f"The batch size changed from {self._batch_size} to {size}: pipeline stages are built for fixed "
                "shapes (pytorch#159942). Use drop_last=True and the same batch size for training and evaluation."
            )
        self._batch_size = size
        return sample

    def _prepare(self, inputs: Any, targets: Any, num_items: Optional[Tensor]) -> tuple[tuple, dict, Tensor]:
        sample = self._check_batch(inputs)
        if num_items is not None:
            self._divisor = torch.as_tensor(num_items, dtype=torch.float32) / self.data_parallel_size
        elif targets is not None:
            self._divisor = self.count_items(targets).to(torch.float32)
        arguments = getattr(self.modules[0], "stage_arguments", None)
        args, kwargs = arguments(inputs) if arguments is not None else ((inputs,), {})
        return (args if self.has_first else ()), kwargs, sample

    def _agreed_loss(self, losses: list[Tensor], device: torch.device) -> Tensor:
        """The batch's loss (this rank's share under data parallelism), sent from the last stage to every rank."""
        if self.has_last:
            # Terms were scaled by loss_scale / divisor (their sum is the loss); means by loss_scale * microbatch_scale.
            stacked = torch.stack([loss.detach().float() for loss in losses])
            scale = self.loss_scale if self._terms else self.loss_scale * self.microbatch_scale
            value = (stacked.sum() if self._terms else stacked.mean()) / scale
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            value = value.to(device)
        else:
            # float32 as on the last stage: under bf16-true the default dtype is bfloat16 here.
            value = torch.zeros((), device=device, dtype=torch.float32)
        dist.broadcast(value, src=self.last_stage_rank, group=self.group)
        return value

    def train_step(
        self, inputs: Any, targets: Any, loss_scale: float = 1.0, num_items: Optional[Tensor] = None
    ) -> Tensor:
        """Forward and backward of every micro-batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch's model input: a tensor, a tuple of tensors, or (Hugging Face)
                a dict of ``input_ids`` and side inputs such as ``attention_mask``.
            targets: its targets (used by the last stage).
            loss_scale: multiplies each micro-batch loss before backward (1/accumulation).
            num_items: with loss terms, the items carrying a loss in the whole batch summed
                over the data-parallel ranks (a tensor); None counts this rank's batch.

        Returns:
            The batch's loss (unscaled), identical on every pipeline rank: the mean loss, or
            with terms ``local loss sum / (num_items / data_parallel_size)``, whose mean over
            the data-parallel ranks is the global token-weighted mean.
        """
        args, kwargs, sample = self._prepare(inputs, targets, num_items)
        self.loss_scale = loss_scale
        losses: list[Tensor] = []
        tied_module = self._tied_holder()
        before = pipeline_tied.snapshot_gradients(tied_module, self.tied) if self.tied else []
        self.schedule.step(
            *args,
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
            **kwargs,
        )
        if self.tied:
            pipeline_tied.sum_tied_gradients(tied_module, self.tied, before, group=None)
        return self._agreed_loss(losses, sample.device)

    def _tied_holder(self) -> nn.Module:
        """A module where every tied copy of this rank can be found by its qualified name."""
        return _NameUnion(self.modules)  # type: ignore[return-value]

    def eval_step(
        self, inputs: Any, targets: Any, num_items: Optional[Tensor] = None
    ) -> tuple[Optional[Tensor], Optional[Any]]:
        """Forward only.

        Returns (loss as :meth:`train_step` does, or None without targets; last-stage outputs or None).
        """
        args, kwargs, sample = self._prepare(inputs, targets, num_items)
        self.loss_scale = 1.0
        losses: list[Tensor] = []
        with_loss = targets is not None
        self._predicting = not with_loss
        target = targets if with_loss else torch.zeros(sample.shape[0], device=sample.device)
        try:
            with torch.no_grad():
                outputs = self.schedule.eval(
                    *args, target=target if self.has_last else None, losses=losses if self.has_last else None, **kwargs
                )
        finally:
            self._predicting = False
        loss = self._agreed_loss(losses, sample.device) if with_loss else None
        return loss, outputs if self.has_last else None

    def broadcast_outputs(self, outputs: Optional[Tensor]) -> Tensor:
        """Send the last stage's outputs to every pipeline rank (predict returns them everywhere)."""
        box = [outputs.cpu() if outputs is not None else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.group)
        return box[0]


class _NameUnion:
    """Looks a qualified parameter name up in whichever of several stage modules holds it."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules

    def get_parameter(self, name: str) -> nn.Parameter:
        for mod in self.modules:
            try:
                return mod.get_parameter(name)
            except AttributeError:
                continue
        raise AttributeError(f"No local pipeline stage holds {name!r}.")
