"""Timestamps of every pipeline compute action, for bubble measurement and Gantt charts.

Note:
    torch's schedules can *simulate* a timeline from the schedule IR, but a measured one
    needs the times the work actually ran. The recorder wraps the three compute entry
    points of a ``PipelineStage`` (forward, full or input backward, weight backward) on the
    instance, so the schedule code is untouched and recording can be switched off by
    detaching.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


@dataclass(frozen=True)
class ComputeEvent:
    """One compute action on one stage.

    Attributes:
        stage: stage index.
        kind: ``F`` forward, ``B`` backward (full, or input-grad for zero-bubble), ``W`` weight-grad.
        microbatch: micro-batch index.
        start: ``time.perf_counter()`` at entry (seconds).
        end: ``time.perf_counter()`` at exit.
    """

    stage: int
    kind: str
    microbatch: int
    start: float
    end: float


class StageTimeline:
    """Records :class:`ComputeEvent` s of the given pipeline stages (one process).

    Args:
        stages: ``PipelineStage`` objects of this rank.
    """

    def __init__(self, stages: Sequence[Any]) -> None:
        self.events: list[ComputeEvent] = []
        self._originals: list[tuple[Any, str, Any]] = []
        for stage in stages:
            for method, kind in _ACTIONS.items():
                original = getattr(stage, method)
                self._originals.append((stage, method, original))
                setattr(stage, method, self._wrap(original, stage.stage_index, kind))

    def _wrap(self, fn: Any, stage: int, kind: str) -> Any:
        @functools.wraps(fn)
        def timed(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                self.events.append(ComputeEvent(stage, kind, chunk_id, start, time.perf_counter()))

        return timed

    def detach(self) -> None:
        """Restore the stages' own methods."""
        for stage, method, original in self._originals:
            setattr(stage, method, original)
        self._originals.clear()

    def clear(self) -> None:
        self.events.clear()


def idle_fraction(events: Sequence[ComputeEvent], window: tuple[float, float]) -> float:
    """Share of ``window`` (start, end) in which this rank computed nothing.

    Args:
        events: this rank's events of one step.
        window: the step's start and end, common to all ranks (see :func:`step_window`).
    """
    start, end = window
    busy = sum(min(e.end, end) - max(e.start, start) for e in events if e.end > start and e.start < end)
    return max(0.0, 1.0 - busy / (end - start))


def step_window(per_rank_events: Sequence[Sequence[ComputeEvent]]) -> tuple[float, float]:
    """First start and last end over all ranks' events of one step (clocks of one machine)."""
    starts = [e.start for events in per_rank_events for e in events]
    ends = [e.end for events in per_rank_events for e in events]
    return min(starts), max(ends)


def theoretical_bubble(pipeline_parallel: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of an ideal schedule: (p-1)/(v*m+p-1) (v=1 for GPipe and 1F1B)."""
    p, m, v = pipeline_parallel, microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)


def median_idle(per_step_per_rank: Sequence[Sequence[Sequence[ComputeEvent]]]) -> list[float]:
    """Median idle fraction per rank over steps (``[step][rank] -> events``)."""
    ranks = len(per_step_per_rank[0])
    fractions: list[list[float]] = [[] for _ in range(ranks)]
    for step in per_step_per_rank:
        window = step_window(step)
        for rank, events in enumerate(step):
            fractions[rank].append(idle_fraction(events, window))
    return [statistics.median(f) for f in fractions]
