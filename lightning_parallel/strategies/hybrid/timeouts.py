"""Collective timeouts re-raised with what the strategy knows: rank, mesh position, phase and step.

Note:
    gloo reports only "Timed out waiting 5000ms for recv operation"; the collective sits
    deep inside DTensor, FSDP2 or the pipeline schedule, so the strategy adds which rank,
    where in the mesh, which phase of which step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from lightning_parallel.runtime import rank_record


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the strategy's timeout: another rank died or stalled."""


def timeout_message(strategy: Any, phase: str, error: BaseException) -> str:
    """The message of a :class:`CollectiveTimeout` raised by ``strategy`` during ``phase``."""
    layout = getattr(strategy, "layout", None)
    coords = tuple(layout.coordinates(strategy.global_rank)) if layout is not None else "?"
    try:
        step = strategy.lightning_module.trainer.global_step
    except (AttributeError, RuntimeError):  # no module, or a module not attached to a Trainer
        step = "?"
    record = rank_record.current()  # set by the RankRecorder callback (lp-train's default callbacks)
    where = f" {record.where_others_were()}" if record is not None else ""
    return (
        f"Rank {strategy.global_rank} (data, pipeline, tensor = {coords}) timed out after {strategy.options.timeout} "
        f"in {phase} at global step {step}: another rank died or stalled. Check the other ranks' logs; raise "
        f"strategy.timeout if a step legitimately takes longer.{where} ({error})"
    )


def names_timeouts(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a strategy method so that a collective timeout inside it becomes a :class:`CollectiveTimeout`.

    Args:
        phase: what the method does, for the message (e.g. ``"training_step (pipeline schedule ...)"``).
    """

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(strategy: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(strategy, *args, **kwargs)
            except RuntimeError as error:
                if isinstance(error, CollectiveTimeout) or "timed out" not in str(error).lower():
                    raise
                raise CollectiveTimeout(timeout_message(strategy, phase, error)) from error

        return run

    return wrap
