"""The communication of one step, counted where it happens: every collective and point-to-point call torch's
dispatcher sees, by kind, mesh axis and bytes.

:class:`CountCollectives` is a ``TorchDispatchMode``: the ``c10d`` ops FSDP2, DTensor, the pipeline schedules and the
suite's own reductions issue (and the functional collectives DTensor uses) pass through it with their tensors and
process group, in a simulated rank on ``meta`` as in a real gloo run -- the same counter measures both, so the two can
be compared call for call (``tests/distributed/planner/test_simulation_collectives.py``).

A call's bytes are those of its largest tensor on this rank: the gathered output of an all-gather, the unreduced
input of a reduce-scatter, the buffer of an all-reduce, broadcast, send or receive; an all-to-all's are its input's,
what this rank sends (with uneven split sizes -- an MoE dispatch -- what a rank receives changes with the routing,
while what it sends, and what an expert group receives in all, does not).

Note:
    torch's DDP reduces its buckets from C++ (its reducer calls the process group directly), out of the dispatcher's
    sight in a simulated rank, which runs without the wrapper (it cannot wrap a ``meta`` model): its all-reduces are
    added from DDP's bucket arithmetic (:func:`ddp_buckets`). In a real run the counter sees them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

from lightning_parallel import _compat

# c10d op name (without the trailing "_") -> the kind it is reported as
_KINDS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "send": "send", "recv": "recv", "recv_any_source": "recv",
}


def group_axes(meshes: Any) -> dict[str, str]:
    """Process group name -> the mesh axis it is, for every axis ``meshes`` has (the first name of a shared group).

    Args:
        meshes: the run's :class:`~lightning_parallel.layout.meshes.RunMeshes`.
    """
    from lightning_parallel.layout.meshes import AXES

    names: dict[str, str] = {}
    for axis in AXES:
        try:
            group = meshes.group(axis)
        except (ValueError, KeyError, RuntimeError):
            continue  # an axis this layout does not have
        names.setdefault(group.group_name, axis)
    return names


def _sent(func: Any, args: tuple) -> Any:
    """What an all-to-all sends from this rank: its input (the functional op's first argument, c10d's second)."""
    return args[0] if func.namespace.startswith("_c10d_functional") else args[1]


def leaves(value: Any) -> list[Any]:
    """Everything inside nested lists, tuples and dicts of an operator's arguments (the collective counter's and the
    routing mode's one reading of them).

    Args:
        value: an operator's arguments, or any part of them.
    """
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in leaves(item)]
    return [value]


class CountCollectives(_compat.dispatch_mode()):  # type: ignore[misc]
    """Counts every communication call made inside it (module docstring).

    Args:
        axes: process group name -> mesh axis (:func:`group_axes`); other groups are named by their size.

    Attributes:
        calls: ``(kind, axis, bytes)`` of each call, in order.
    """

    def __init__(self, axes: Mapping[str, str]) -> None:
        super().__init__()
        self.axes = dict(axes)
        self.calls: list[tuple[str, str, int]] = []
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            kind = _KINDS.get(func.overloadpacket.__name__.rstrip("_"))
            if kind is not None:
                arguments = leaves((args, kwargs))
                sent = kind == "all_to_all"
                sizes = [t.numel() * t.element_size() for t in (leaves(_sent(func, args)) if sent else arguments)
                         if isinstance(t, torch.Tensor)]
                self.calls.append((kind, self._axis(arguments), sum(sizes) if sent else max(sizes, default=0)))
        return func(*args, **kwargs)

    def _axis(self, leaves: Iterable[Any]) -> str:
        import torch.distributed as dist

        named = [leaf for leaf in leaves if isinstance(leaf, str)]
        for leaf in leaves:
            if isinstance(leaf, str) and leaf in self.axes:
                return self.axes[leaf]  # a functional collective names its group
            if isinstance(leaf, (torch.ScriptObject, dist.ProcessGroup)):
                group = leaf if isinstance(leaf, dist.ProcessGroup) else dist.ProcessGroup.unbox(leaf)
                return self.axes.get(group.group_name, f"a group of {group.size()}")
        return f"group {named[-1]}" if named else "unknown group"

    def summary(self) -> list[dict[str, Any]]:
        """The calls by ``(kind, axis)``: ``{"kind", "axis", "count", "bytes"}``, in order of first call."""
        return summarize(self.calls)


def summarize(calls: Iterable[tuple[str, str, int]]) -> list[dict[str, Any]]:
    """``(kind, axis, bytes)`` calls grouped by kind and axis, each with its count and summed bytes."""
    counts: Counter = Counter()
    total: Counter = Counter()
    for kind, axis, size in calls:
        counts[(kind, axis)] += 1
        total[(kind, axis)] += size
    return [{"kind": k, "axis": a, "count": counts[(k, a)], "bytes": total[(k, a)]} for k, a in counts]


def ddp_buckets(parameters: Iterable[torch.Tensor], bucket_bytes: int) -> list[int]:
    """Bytes of each bucket torch's DDP all-reduces in a step after its first (the buckets rebuilt then).

    DDP fills buckets in the order gradients become ready (about the reverse of the parameters' order), one dtype
    per bucket, closing a bucket once it holds ``bucket_bytes`` or more. Its first step reduces one bucket per dtype
    (it does not bucket before it has seen the order), which a single bucket here also gives when everything fits.

    Args:
        parameters: the trainable parameters, in the module's order.
        bucket_bytes: DDP's bucket capacity (``ParallelOptions.bucket_bytes``; 0: one bucket per parameter).
    """
    open_buckets: dict[torch.dtype, int] = {}
    closed = []
    for param in reversed(list(parameters)):
        size = open_buckets.get(param.dtype, 0) + param.numel() * param.element_size()
        if size >= max(bucket_bytes, 1):
            closed.append(size)
            open_buckets.pop(param.dtype, None)
        else:
            open_buckets[param.dtype] = size
    return closed + list(open_buckets.values())
