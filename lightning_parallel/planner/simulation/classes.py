"""Rank classes: the ranks of a world that hold the same shapes, simulated once per class.

Every rank of one pipeline position holds the same parameters, split by the same placements; they differ only in
which piece of each they hold (their tensor, FSDP shard, expert coordinates), and where a split is uneven, in the
piece's size. So one rank per pipeline position is simulated first; the chunk arithmetic of :mod:`.shards` then gives
every other rank of that position its local shapes, the ranks are grouped by them, and one more rank is simulated for
each group of other shapes (e.g. the last FSDP2 shard of a dimension that does not divide). Each simulated rank's
shapes are checked against the arithmetic, so a class can never hide a rank that torch would build differently.

Why two ranks share a class is said in :attr:`RankClass.why`: the same pipeline position, and the same local shapes
-- the axes whose coordinates differ inside it (data replicas, context ranks, tensor or shard coordinates of an even
split) change which piece a rank holds, not its size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.planner.simulation.rank_run import RankRecord
from lightning_parallel.planner.simulation.shards import ParamSpec, rank_coordinates


@dataclass
class RankClass:
    """Ranks that hold the same shapes, and the one simulated for them.

    Attributes:
        ranks: the ranks of the class (sorted).
        record: what its simulated representative holds.
        why: why these ranks are one class.
    """

    ranks: tuple[int, ...]
    record: RankRecord
    why: str


def split_axes(specs: Sequence[ParamSpec]) -> tuple[str, ...]:
    """The mesh axes that split at least one of ``specs`` (the coordinates that decide a rank's pieces)."""
    return tuple(sorted({s.axis for spec in specs for s in spec.splits if s.dim is not None}))


def shapes_at(specs: Sequence[ParamSpec], coordinates: dict[str, int]) -> tuple[tuple[int, ...], ...]:
    """Local shapes of ``specs`` at ``coordinates``."""
    return tuple(spec.local_shape(coordinates) for spec in specs)


def rank_classes(layout: ParallelLayout, zero_stage: int, simulate: Callable[[int], RankRecord]) -> list[RankClass]:
    """Every rank of ``layout`` in exactly one class, each class's representative simulated by ``simulate(rank)``.

    Args:
        layout: the resolved layout.
        zero_stage: the run's ZeRO stage (FSDP2's data mesh).
        simulate: plays one rank and returns what it holds.

    Raises:
        ValueError: a simulated rank holds shapes other than the shard arithmetic says (the class would be wrong).
    """
    coordinates = [rank_coordinates(layout, zero_stage, rank) for rank in range(layout.world_size)]
    by_position: dict[int, list[int]] = defaultdict(list)
    for rank, where in enumerate(coordinates):
        by_position[where["pipeline_parallel"]].append(rank)
    classes = []
    for position, ranks in sorted(by_position.items()):
        first = simulate(layout.rank_at(0, position, 0, 0))
        groups = _group_by_shapes(first.specs, ranks, coordinates)
        for shapes, members in groups.items():
            record = first if first.rank in members else simulate(members[0])
            _check_prediction(record, shapes)
            classes.append(RankClass(tuple(members), record, _why(position, record, members, coordinates)))
    return classes


def _group_by_shapes(specs: Sequence[ParamSpec], ranks: Sequence[int], coordinates: Sequence[dict[str, int]]
                     ) -> dict[tuple, list[int]]:
    """``ranks`` grouped by the local shapes the arithmetic gives them (each distinct coordinate tuple once)."""
    axes = split_axes(specs)
    shapes_of: dict[tuple[int, ...], tuple] = {}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank in ranks:
        key = tuple(coordinates[rank][axis] for axis in axes)
        if key not in shapes_of:
            shapes_of[key] = shapes_at(specs, coordinates[rank])
        groups[shapes_of[key]].append(rank)
    return dict(groups)


def _check_prediction(record: RankRecord, shapes: tuple) -> None:
    if tuple(record.local_shapes) == tuple(shapes):
        return
    wrong = next(i for i, (a, b) in enumerate(zip(record.local_shapes, shapes)) if tuple(a) != tuple(b))
    spec = record.specs[wrong]
    raise ValueError(
        f"rank {record.rank} holds {spec.name} as {tuple(record.local_shapes[wrong])}, but the shard arithmetic of "
        f"its placements {spec.splits} says {shapes[wrong]}: lp-simulate does not know this placement; simulate "
        "every rank (classes would be wrong) and report it.")


def _why(position: int, record: RankRecord, members: Sequence[int], coordinates: Sequence[dict[str, int]]) -> str:
    """One line: the shared pipeline position and shapes, and which coordinates vary inside the class."""
    stages = f" (stages {', '.join(map(str, record.stages))})" if record.stages else ""
    varying = []
    axes = dict.fromkeys(("data_parallel", "context_parallel", "tensor_parallel", *split_axes(record.specs)))
    for axis in axes:  # the run's axes, and the mesh axes that split a parameter (FSDP2's shard, experts)
        values = sorted({coordinates[r][axis] for r in members})
        if len(values) > 1:
            varying.append(f"{axis} {_span(values)}")
    fixed = [f"{axis} {coordinates[members[0]][axis]}" for axis in split_axes(record.specs)
             if len({coordinates[r][axis] for r in members}) == 1]
    return (f"pipeline position {position}{stages}; same local shapes"
            + (f" ({', '.join(fixed)})" if fixed else "")
            + (f"; differ only in which piece they hold: {', '.join(varying)}" if varying else ""))


def _span(values: Sequence[int]) -> str:
    if len(values) > 2 and values[-1] - values[0] == len(values) - 1:
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values)) if len(values) <= 6 else f"{len(values)} values {values[0]}..{values[-1]}"
