"""Count collectives and point-to-point transfers per step, in the benchmark process only.

Two sources, kept apart so nothing is counted twice:

* ``torch.distributed`` calls (``all_reduce``, ``reduce_scatter_tensor``, ``isend``,
  ``irecv``, ...): the functions are replaced on ``torch.distributed`` *and*
  ``torch.distributed.distributed_c10d`` while a :class:`CommCounter` is active (both, so
  ``P2POp``'s own check of ``op in (isend, irecv)`` still passes and ``batch_isend_irecv``
  reaches the counted functions). torch's pipelining stages, DeepSpeed's comm layer and
  this suite's gradient all-reduce all call them there. DDP's C++ reducer does not; its
  all-reduces per step are its bucket count (read from DDP, see :func:`ddp_buckets`).
* DTensor's functional collectives (``_c10d_functional.*``), seen by a dispatch mode --
  the hook torch's ``CommDebugMode`` uses -- keeping the input's bytes too.

Note:
    Bytes are the payload on the calling rank: a collective's input tensor, a send's or a
    receive's tensor. They are not wire bytes (a ring all-reduce moves ~2(n-1)/n of it).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

# torch.distributed functions counted (a call inside another counted call is not counted again).
COUNTED = (
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter",
    "broadcast", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
    "broadcast_object_list", "all_gather_object", "barrier",
)
_FUNCTIONAL = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class CommCounter:
    """Context manager counting communication calls and their payload bytes on this rank.

    Attributes:
        counts: ``{op: calls}``; DTensor's functional collectives are ``dtensor.<op>``.
        bytes: ``{op: payload bytes}``.
    """

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: Any = None
        self._depth = 0

    def record(self, name: str, payload: int) -> None:
        self.counts[name] += 1
        self.bytes[name] += payload

    def _wrap(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                # DeepSpeed passes keywords (output_tensor=, input_tensor=): take the input then.
                first = args[0] if args else kwargs.get("tensor", kwargs.get("input_tensor", kwargs.get("object_list")))
                self.record(name, 0 if name == "barrier" else _nbytes(first))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CommCounter:
        for name in COUNTED:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            for namespace in (dist, c10d):
                self._saved.append((namespace, name, getattr(namespace, name)))
                setattr(namespace, name, wrapped)
        # DeepSpeed binds all_gather_into_tensor / reduce_scatter_tensor once, when its comm
        # backend starts (ZeRO-3's parameter gathers go through them): wrap those bindings too.
        import sys

        backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        for attr, name in (
            ("all_gather_function", "all_gather_into_tensor"),
            ("reduce_scatter_function", "reduce_scatter_tensor"),
        ):
            if callable(getattr(backend, attr, None)):
                self._saved.append((backend, attr, getattr(backend, attr)))
                setattr(backend, attr, self._wrap(name, getattr(backend, attr)))
        self._mode = _FunctionalCollectives(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        for namespace, name, fn in reversed(self._saved):
            setattr(namespace, name, fn)
        self._saved.clear()

    def summary(self, steps: int = 1) -> dict[str, dict[str, float]]:
        """``{op: {"count": calls per step, "bytes": bytes per step}}`` over ``steps`` counted steps."""
        return {op: {"count": self.counts[op] / steps, "bytes": self.bytes[op] / steps} for op in sorted(self.counts)}


class _FunctionalCollectives(TorchDispatchMode):
    """Counts DTensor's functional collectives with their input bytes (c10d ops are left to the wrappers)."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func.namespace in _FUNCTIONAL:
            name = func.__name__.split(".")[0]
            if any(k in name for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")):
                self.counter.record(f"dtensor.{name}", _nbytes(args[0]) if args else 0)
        return func(*args, **(kwargs or {}))


def ddp_buckets(module: Any) -> list[int]:
    """Bytes of each gradient bucket of a ``DistributedDataParallel`` module: one all-reduce each per step.

    DDP's reducer all-reduces from C++, past the Python wrappers, so its calls are read from
    the bucket layout DDP logs instead of counted.
    """
    data = module._get_ddp_logging_data()
    sizes = data.get("bucket_sizes", "")
    return [int(s) for s in str(sizes).split(",") if s.strip()]
