"""Simulate one step of a pipeline schedule from its action lists: step time, bubble and activations in flight.

Note:
    torch.distributed.pipelining keeps a multi-stage schedule as data: ``pipeline_order`` maps
    each pipeline rank to its list of actions (``0F1`` forward of stage 0 on micro-batch 1,
    ``I``/``W`` the two halves of a zero-bubble backward). The schedule classes build it in
    their constructor from the stages' count, group size and rank alone, so stand-in stage
    objects carrying those numbers get the real order without processes. GPipe and 1F1B hold
    one stage per rank and build no per-rank list; their orders are written here (the textbook
    ones torch runs). Each rank then executes its list in order; an action waits for the
    action it depends on (the previous stage's forward, the next stage's backward), plus one
    point-to-point transfer when that ran on another rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from lightning_parallel.parallel.pipeline.schedules import SCHEDULES

Action = tuple[str, int, int]  # (kind F | B | I | W, stage, micro-batch)


@dataclass(frozen=True)
class Simulated:
    """One simulated step.

    Args:
        step_time: seconds from the first forward to the last backward.
        busy: compute seconds of each rank.
        peak_in_flight: per rank, the largest activation bytes held at once (forwards not yet backwarded).
    """

    step_time: float
    busy: tuple[float, ...]
    peak_in_flight: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """Mean idle share of the step over the ranks."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time) if self.step_time else 0.0


def _single_stage_orders(schedule: str, p: int, m: int) -> dict[int, list[Action]]:
    orders = {}
    for r in range(p):
        if schedule == "gpipe":
            orders[r] = [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            continue
        warmup = min(m, p - r - 1)
        actions = [("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", r, warmup + i), ("B", r, i)]
        actions += [("B", r, i) for i in range(m - warmup, m)]
        orders[r] = actions
    return orders


def _flatten(action) -> list[Action]:
    if action is None:
        return []
    if action.sub_actions:
        return [a for sub in action.sub_actions for a in _flatten(sub)]
    kind = action.computation_type.value
    return [(kind, action.stage_index, action.microbatch_index)] if kind in ("F", "B", "I", "W") else []


@lru_cache(maxsize=256)
def rank_orders(schedule: str, p: int, v: int, m: int) -> dict[int, tuple[Action, ...]]:
    """Each pipeline rank's compute actions, in order, for ``p`` ranks x ``v`` stages per rank x ``m`` micro-batches."""
    if SCHEDULES[schedule][1] == "one":
        return {r: tuple(a) for r, a in _single_stage_orders(schedule, p, m).items()}
    import torch
    from torch.distributed.pipelining import schedules

    from lightning_parallel.parallel.pipeline.schedules import stage_ids_for_rank

    cls = getattr(schedules, SCHEDULES[schedule][0])
    ids = stage_ids_for_rank(schedule, 0, p, v)
    stand_ins = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, stage_index=i, is_first=i == 0,
                                 is_last=i == p * v - 1, submod=torch.nn.Identity()) for i in ids]
    order = cls(stand_ins, m).pipeline_order
    return {r: tuple(a for action in order[r] for a in _flatten(action)) for r in range(p)}


def _dependencies(kind: str, stage: int, mb: int, last: int) -> tuple[tuple[str, int, int], ...]:
    """The actions ``(kind, stage, mb)`` waits for (any one of them, for a backward that may be split)."""
    if kind == "F":
        return (("F", stage - 1, mb),) if stage > 0 else ()
    if kind == "W":
        return (("I", stage, mb),)
    return (("F", stage, mb),) if stage == last else (("B", stage + 1, mb), ("I", stage + 1, mb))


def simulate(orders: dict[int, Sequence[Action]], forward: Sequence[float], backward: Sequence[float],
             activation: Sequence[float], transfer: float) -> Simulated:
    """Run the action lists against per-stage times.

    Args:
        orders: :func:`rank_orders`.
        forward: forward seconds of one micro-batch, per stage.
        backward: backward seconds (input + weight gradients) of one micro-batch, per stage.
        activation: bytes one micro-batch's forward keeps until its backward, per stage.
        transfer: seconds of one point-to-point send between ranks.
    """
    last = len(forward) - 1
    ranks = sorted(orders)
    owner = {a[1]: r for r, acts in orders.items() for a in acts}
    cost = {"F": forward, "B": backward}
    held = {"F": 1.0, "B": -1.0, "I": -1.0, "W": 0.0}
    finish: dict[tuple[str, int, int], float] = {}
    clock, pos, live, peak, busy = ([0.0] * len(ranks), [0] * len(ranks), [0.0] * len(ranks), [0.0] * len(ranks),
                                    [0.0] * len(ranks))
    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for r in ranks:
            acts = orders[r]
            while pos[r] < len(acts):
                action = acts[pos[r]]
                kind, stage, _ = action
                ready = 0.0
                deps = _dependencies(*action, last)
                if deps:
                    done = next((d for d in deps if d in finish), None)
                    if done is None:
                        break
                    ready = finish[done] + (transfer if owner[done[1]] != r else 0.0)
                seconds = cost[kind][stage] if kind in cost else backward[stage] / 2
                clock[r] = finish[action] = max(clock[r], ready) + seconds
                busy[r] += seconds
                live[r] += held[kind] * activation[stage]
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("The schedule's action lists wait on each other: the order cannot run.")
    return Simulated(max(clock), tuple(busy), tuple(peak))
