"""Cut an ordered list of layers into contiguous pipeline stages.

Methods:

* ``uniform`` -- equal layer counts (the first stages take one extra when it does not divide);
* ``parameters`` -- balanced parameter counts;
* ``time`` -- balanced measured forward+backward time per layer on a sample batch
  (torchgpipe's ``balance_by_time``);
* an explicit list of cut points: ``[3, 5]`` puts layers 0-2, 3-4 and 5-end in three stages.

A partition is a list of ``num_stages + 1`` boundaries; stage ``s`` owns layers
``range(bounds[s], bounds[s + 1])``.

Note:
    torch.distributed.pipelining splits a traced graph (``pipeline()`` with split points)
    or takes hand-made stage modules; it has no balancing by cost. The balanced split is
    the classic linear-partition problem (minimise the most loaded stage), solved exactly
    by dynamic programming -- the layer counts here are small.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Union

import torch
from torch import Tensor, nn

Partition = list[int]
PartitionSpec = Union[str, Sequence[int]]
METHODS = ("uniform", "parameters", "time")


def stage_of_layer(bounds: Partition) -> list[int]:
    """For every layer, the stage that owns it."""
    return [stage for stage in range(len(bounds) - 1) for _ in range(bounds[stage], bounds[stage + 1])]


def _check_counts(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1.")
    if num_layers < num_stages:
        raise ValueError(
            f"Cannot cut {num_layers} pipeline layers into {num_stages} stages: every stage needs at least one layer. "
            f"Use pipeline_parallel_size x stages_per_rank <= {num_layers}, or give the model more layers."
        )


def uniform_partition(num_layers: int, num_stages: int) -> Partition:
    """Equal layer counts per stage (earlier stages take the remainder)."""
    _check_counts(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return bounds


def balanced_partition(weights: Sequence[float], num_stages: int) -> Partition:
    """Contiguous split minimising the largest stage weight (exact dynamic programme).

    Ties are broken towards earlier cuts, so equal weights give the uniform split.

    Args:
        weights: non-negative cost of each layer, in order.
        num_stages: number of stages.
    """
    n = len(weights)
    _check_counts(n, num_stages)
    if any(w < 0 for w in weights):
        raise ValueError("Layer weights must be non-negative.")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: smallest achievable max-stage weight putting the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-12 * max(1.0, abs(cost)):
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def explicit_partition(cuts: Sequence[int], num_layers: int, num_stages: int) -> Partition:
    """Boundaries from user cut points (the first layer of each stage after the first)."""
    _check_counts(num_layers, num_stages)
    cuts = [int(c) for c in cuts]
    if len(cuts) != num_stages - 1:
        raise ValueError(
            f"partition={cuts} gives {len(cuts) + 1} stages but the layout has {num_stages}: "
            f"pass {num_stages - 1} cut points (the first layer index of stages 1..{num_stages - 1})."
        )
    bounds = [0, *cuts, num_layers]
    if any(b >= a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(
            f"partition={cuts} must be strictly increasing cut points between 1 and {num_layers - 1} "
            "so that every stage has at least one layer."
        )
    return bounds


def parameter_counts(layers: Sequence[nn.Module]) -> list[int]:
    """Number of parameter elements of each layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def measure_layer_times(layers: Sequence[nn.Module], sample: Tensor, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each layer, feeding each layer the previous one's output.

    Args:
        layers: the pipeline layers, in order (on the device where they will run).
        sample: an input batch for the first layer.
        repeats: timed repetitions per layer (after one warm-up).
    """
    times = []
    x = sample
    for layer in layers:
        runs = []
        for attempt in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out)) if out.requires_grad else None
            elapsed = time.perf_counter() - start
            if attempt:
                runs.append(elapsed)
        layer.zero_grad(set_to_none=True)
        times.append(sorted(runs)[len(runs) // 2])
        with torch.no_grad():
            x = layer(x)
    return times


def partition_layers(
    layers: Sequence[nn.Module],
    num_stages: int,
    method: PartitionSpec = "parameters",
    layer_times: Sequence[float] | None = None,
) -> Partition:
    """Choose stage boundaries for ``layers``.

    Args:
        layers: the module's ``pipeline_layers()``.
        num_stages: total stages (pipeline size x stages per rank).
        method: ``uniform``, ``parameters``, ``time`` or a list of cut points.
        layer_times: per-layer costs for ``time`` (measure with :func:`measure_layer_times`
            and agree on them across ranks first: every rank must compute the same split).

    Raises:
        ValueError: unknown method, too few layers, or bad cut points.
    """
    if isinstance(method, str):
        if method == "uniform":
            return uniform_partition(len(layers), num_stages)
        if method == "parameters":
            return balanced_partition(parameter_counts(layers), num_stages)
        if method == "time":
            if layer_times is None:
                raise ValueError("partition='time' needs measured layer_times (see measure_layer_times).")
            return balanced_partition(layer_times, num_stages)
        raise ValueError(f"Unknown partition {method!r}: use one of {METHODS} or a list of cut points such as [3, 5].")
    return explicit_partition(method, len(layers), num_stages)
