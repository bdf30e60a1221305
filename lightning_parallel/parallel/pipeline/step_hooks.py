"""What a module's pipeline-step hooks receive: the groups and the schedule of one training step.

A pipeline schedule runs forward and backward of every micro-batch inside the strategy's ``training_step``, so a
module's own ``training_step`` (where a loss beyond the model output's, such as a router's balancing loss, would be
formed) is not called, and each rank holds only its stage's layers. A module that needs a term over the whole step
offers two optional hooks (:mod:`lightning_parallel.protocol`), called on every rank around each training schedule:

* ``pipeline_step_begin(step)``: before the schedule's first forward (set up what the layers will need);
* ``pipeline_step_end(step) -> Tensor | None``: after its last backward; a returned scalar (the same on every
  rank: sum the stages' parts with :meth:`PipelineStep.stage_sum`) is added to the step's loss. Its gradient is
  the module's to have put in place during the schedule (for example at a layer's output in the backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist
from torch import Tensor

#: Schedules that run every forward of a step on a rank before that rank's first backward: a term whose gradient
#: needs statistics of the whole step (all micro-batches) can be exact under them, and only under them.
FORWARDS_FIRST = ("gpipe", "looped_bfs")


@dataclass(frozen=True)
class PipelineStep:
    """One training step of the pipeline schedule, as the module's hooks see it.

    Attributes:
        microbatches: micro-batches per batch: each layer runs that many training forwards per step (more under
            activation checkpointing, whose backward recomputes them).
        schedule: the schedule's name (``"1f1b"``, ``"gpipe"``, ...).
        loss_scale: what the schedule multiplies each micro-batch loss by (``1 / accumulate_grad_batches``).
        data_group: the ranks holding other tokens of the same stage (data x context), None when there are none.
        data_size: their number (1 without data or context parallelism).
        pipeline_group: the ranks holding the other stages of the same tokens.
        in_microbatch_forward: ``() -> bool``, True while the schedule runs one of the step's micro-batch forwards:
            torch also runs a stage's layers to infer shapes (first step, and after an evaluation), which a
            step-wide statistic must not count (:mod:`.microbatch_stage`).
    """

    microbatches: int
    schedule: str
    loss_scale: float
    data_group: Optional[dist.ProcessGroup]
    data_size: int
    pipeline_group: dist.ProcessGroup
    in_microbatch_forward: Callable[[], bool] = lambda: True

    @property
    def forwards_first(self) -> bool:
        """Whether the schedule runs all of a step's forwards before its first backward (:data:`FORWARDS_FIRST`)."""
        return self.schedule in FORWARDS_FIRST

    def data_sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the data (x context) ranks of this stage (a collective there; a new tensor)."""
        value = value.detach().clone()
        if self.data_group is not None:
            dist.all_reduce(value, group=self.data_group)
        return value

    def data_mean(self, value: Tensor) -> Tensor:
        """``value``'s mean over the data (x context) ranks of this stage."""
        return self.data_sum(value) / self.data_size

    def stage_sum(self, value: Tensor) -> Tensor:
        """``value`` summed over the pipeline stages (every rank of the pipeline group calls it)."""
        value = value.detach().clone()
        dist.all_reduce(value, group=self.pipeline_group)
        return value

    def stage_max(self, value: Tensor) -> Tensor:
        """``value``'s largest over the pipeline stages."""
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.pipeline_group)
        return value

