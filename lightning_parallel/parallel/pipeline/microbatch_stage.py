"""torch's ``PipelineStage`` that says whether it is running one of the schedule's micro-batch forwards.

torch runs a stage's module outside the micro-batches too: when it (re)initialises the stages -- on the first step,
and on the first training step after an evaluation with the same schedule -- it infers the shapes by a forward and a
backward of its own (``torch/distributed/pipelining/stage.py``, metadata inference, under a forked RNG). A module
keeping statistics over a step's micro-batches (a router's balancing loss, :mod:`.step_hooks`) must not count that
forward. Every schedule runs its real forwards through the public ``forward_one_chunk``; this subclass marks them.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import PipelineStage


class MicrobatchStage(PipelineStage):
    """A ``PipelineStage`` whose ``in_microbatch_forward`` is True while a schedule runs a micro-batch forward."""

    in_microbatch_forward = False

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        self.in_microbatch_forward = True
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.in_microbatch_forward = False
