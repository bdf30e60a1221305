"""The whole-world check: every element of every parameter held exactly as often as the layout says.

Over all classes times their ranks, each rank's piece of each parameter (:meth:`~.shards.ParamSpec.region` at its
coordinates) is counted element by element, on the grid the pieces' edges cut each parameter into. The layout says
how often each element is held: the ranks of a pipeline position (world / pipeline size) divided by the pieces its
placements cut the parameter into -- once per replica of that piece (data replicas, context ranks, and the tensor ranks
of a parameter tensor parallelism leaves whole) -- summed over the pipeline positions that hold a copy (a tied
embedding and head on the first and last stage). A lost or doubled shard anywhere, a rank in two classes or in none,
a parameter nobody holds: each is an error naming what is wrong.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.planner.simulation.shards import ParamSpec, rank_coordinates


class WholeWorldError(ValueError):
    """The classes do not hold every element of every parameter as often as the layout says."""


def check_whole_world(classes: Sequence[Any], layout: ParallelLayout, zero_stage: int, names: Iterable[str]) -> int:
    """Raise unless the classes hold every parameter of the model exactly as the layout says; returns elements checked.

    Args:
        classes: :class:`~.classes.RankClass` es (``ranks``, ``record.specs``).
        layout: the resolved layout.
        zero_stage: the run's ZeRO stage.
        names: every parameter name of the unsplit model (first names of tied groups).

    Raises:
        WholeWorldError: what is wrong, named.
    """
    _check_ranks(classes, layout.world_size)
    per_position = layout.world_size // layout.pipeline_parallel
    pieces: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    expected: dict[str, float] = defaultdict(float)
    shapes: dict[str, tuple[int, ...]] = {}
    held_at: set[tuple[str, int]] = set()
    coordinates = [rank_coordinates(layout, zero_stage, rank) for rank in range(layout.world_size)]
    for rank_class in classes:
        specs = rank_class.record.specs
        for position, keys in _coordinate_counts(rank_class.ranks, specs, coordinates).items():
            for spec in specs:
                shapes.setdefault(spec.name, spec.shape)
                if (spec.name, position) not in held_at:  # once per pipeline position holding a copy
                    held_at.add((spec.name, position))
                    expected[spec.name] += per_position / spec.pieces
                for where, times in keys.items():
                    pieces[spec.name][spec.region(dict(where))] += times
    missing = sorted(set(names) - set(shapes))
    if missing:
        raise WholeWorldError(f"no rank holds {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: "
                              "a pipeline stage or a parameter was lost.")
    return sum(_check_parameter(name, shapes[name], pieces[name], expected[name]) for name in sorted(shapes))


def _coordinate_counts(ranks: Sequence[int], specs: Sequence[ParamSpec], coordinates: Sequence[dict[str, int]]
                       ) -> dict[int, dict[tuple, int]]:
    """``{pipeline position: {coordinates on the axes that split specs: ranks there}}`` for the ranks of a class."""
    axes = sorted({s.axis for spec in specs for s in spec.splits if s.dim is not None})
    counts: dict[int, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    for rank in ranks:
        where = coordinates[rank]
        counts[where["pipeline_parallel"]][tuple((axis, where[axis]) for axis in axes)] += 1
    return counts


def _check_ranks(classes: Sequence[Any], world_size: int) -> None:
    seen: dict[int, int] = defaultdict(int)
    for rank_class in classes:
        for rank in rank_class.ranks:
            seen[rank] += 1
    doubled = sorted(r for r, n in seen.items() if n > 1)
    lost = sorted(set(range(world_size)) - set(seen))
    outside = sorted(r for r in seen if not 0 <= r < world_size)
    if doubled or lost or outside:
        raise WholeWorldError(f"the classes must hold every rank of {world_size} once: in two classes "
                              f"{doubled[:8]}, in none {lost[:8]}, outside the world {outside[:8]}.")


def _check_parameter(name: str, shape: tuple[int, ...], pieces: dict[tuple, int], expected: float) -> int:
    """Count how often each cell of ``name``'s grid is held; raise unless every cell is held ``expected`` times."""
    cuts = [sorted({0, size, *(s for region in pieces for s in (region[d][0], region[d][0] + region[d][1]))})
            for d, size in enumerate(shape)]
    counts = np.zeros([max(len(c) - 1, 0) for c in cuts], dtype=np.int64)
    for region, times in pieces.items():
        if any(length == 0 for _, length in region):
            continue
        index = tuple(slice(bisect_left(c, start), bisect_left(c, start + length))
                      for c, (start, length) in zip(cuts, region))
        counts[index] += times
    if counts.size and (counts.min() != expected or counts.max() != expected):
        low, high = int(counts.min()), int(counts.max())
        where = np.argwhere(counts != expected)[0]
        cell = [f"{cuts[d][i]}:{cuts[d][i + 1]}" for d, i in enumerate(where)]
        raise WholeWorldError(
            f"{name} {tuple(shape)}: elements [{', '.join(cell)}] are held {int(counts[tuple(where)])} times, "
            f"the layout says {expected:g} (held {low} to {high} times over the parameter): "
            f"{_verdict(low, high, expected)}.")
    return int(np.prod(shape)) if shape else 1


def _verdict(low: int, high: int, expected: float) -> str:
    found = [("a shard is doubled", high > expected), ("a shard is lost", low < expected)]
    return " and ".join(what for what, wrong in found if wrong)
