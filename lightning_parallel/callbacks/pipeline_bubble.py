"""The pipeline bubble of a run, measured: how much of each training step a pipeline rank spent computing nothing.

Note:
    The fraction is measured from the times the stages' work ran (:class:`StageTimeline` wraps each stage's forward and
    backward entry points), not taken from the schedule's formula: it includes what the formula leaves out (waiting on
    a slower stage, send/receive, the schedule's own Python). Each rank measures against its own step window, from the
    start of the batch to the end of its last stage action, so no collective is added to a step; every rank's median
    reaches rank 0 once, in one all-gather after the last step. The ideal fraction of the schedule,
    ``(p - 1) / (v m + p - 1)``, is logged once beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_parallel.parallel.pipeline.timeline import StageTimeline, theoretical_bubble

IDLE = "pipeline/idle_fraction"
IDEAL = "pipeline/bubble_ideal"


def step_idle_fraction(events: list[Any], started: float) -> Optional[float]:
    """Share of ``[started, end of the last action]`` in which none of this rank's stages computed.

    Args:
        events: this rank's :class:`~lightning_parallel.parallel.pipeline.timeline.ComputeEvent` s of one batch.
        started: ``time.perf_counter()`` at the start of the batch.
    """
    if not events:
        return None
    end = max(e.end for e in events)
    busy = sum(min(e.end, end) - max(e.start, started) for e in events if e.end > started)
    return max(0.0, 1.0 - busy / (end - started)) if end > started else None


class PipelineBubble(pl.Callback):
    """Logs ``pipeline/idle_fraction`` (rank 0, the first stage, every optimizer step; the mean over an accumulation
    window's batches), ``pipeline/bubble_ideal`` once, and ``pipeline/rank<r>/idle_fraction`` (each rank's median)
    at the end of training. Does nothing on a strategy without a pipeline (no ``pipeline_runner``).
    """

    def __init__(self) -> None:
        self.timeline: Optional[StageTimeline] = None
        self.window: list[float] = []
        self.per_step: list[float] = []
        self.medians: dict[int, float] = {}
        self._started = 0.0
        self._logged_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner = getattr(trainer.strategy, "pipeline_runner", None)
        if runner is None:
            return
        self.timeline = StageTimeline(runner.stages)
        self._logged_step = trainer.global_step
        ideal = theoretical_bubble(dist.get_world_size(runner.group), runner.microbatches, len(runner.stages))
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics({IDEAL: ideal}, step=trainer.global_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.timeline is not None:
            self.timeline.clear()  # a validation run in between recorded its forwards too
            self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.timeline is None:
            return
        idle = step_idle_fraction(self.timeline.events, self._started)
        if idle is not None:
            self.window.append(idle)
        if trainer.global_step == self._logged_step or not self.window:
            return  # an accumulation micro-batch: the optimizer has not stepped yet
        self._logged_step = trainer.global_step
        fraction = sum(self.window) / len(self.window)
        self.window.clear()
        self.per_step.append(fraction)
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics({IDLE: fraction}, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timeline is None:
            return
        self.timeline.detach()
        self.timeline = None
        device = trainer.strategy.root_device
        mine = torch.tensor([statistics.median(self.per_step) if self.per_step else float("nan")],
                            dtype=torch.float64, device=device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        self.medians = {rank: float(value) for rank, value in enumerate(every)}
        if trainer.global_rank == 0:
            scalars = {f"pipeline/rank{rank}/idle_fraction": v for rank, v in self.medians.items() if v == v}
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=trainer.global_step)
