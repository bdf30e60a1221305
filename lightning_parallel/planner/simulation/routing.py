"""Balanced routing on ``meta``: an MoE layer's expert-parallel path run in a simulated step, its token counts given.

A mixture-of-experts layer reads values where no shape says what comes next: how many token copies go to each
expert (``bincount`` of the router's choices), how many rows travel to and from each rank of the expert group (the
split sizes of the all-to-all, exchanged first as counts), how many rows each local expert multiplies. ``meta``
tensors have no values, so inside :class:`BalancedRouting` those counts are given, as the planner's arithmetic
(and Megatron-LM's and DeepSpeed's estimators) assume them: every expert receives the same number of copies
(``bincount`` of ``n`` copies over ``E`` experts: ``n // E`` each, the first ``n % E`` one more), and every rank of
an expert group routes as this rank does, so what an all-to-all or all-gather of counts brings in is what this rank
sends. The counts are ordinary CPU tensors with those values; the token rows stay on ``meta``, and an operator that
mixes the two takes the counts to ``meta`` (``repeat_interleave`` told its output size from the counts it knows).

Everything else runs as a real step: the router, the sort of copies by expert, the all-to-all of the rows over the
expert axis (counted by :class:`~.collectives.CountCollectives` with their bytes), the experts' grouped multiply,
the all-to-all back and the weighted sum, forward and backward.

Note:
    A real step's routing is not balanced: a rank whose experts are chosen more often receives more rows (more
    all-to-all bytes back, larger expert activations) and another fewer. What every rank sends in the dispatch
    (its ``tokens x k`` copies, dropless) and the sum over an expert group of what its ranks receive do not depend
    on the routing; per rank the simulation gives the balanced share. Capacity-based dropping is left out: which
    copies an expert keeps is a boolean mask over values (``aten.nonzero``), and the step reports it as not simulated.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_parallel import _compat
from lightning_parallel.planner.simulation.collectives import leaves

_aten = torch.ops.aten
# c10d collectives whose CPU (count) buffers are filled with what this rank sends (every rank routes alike)
_SYMMETRIC = {"alltoall_base_", "all_to_all_single", "allgather_", "_allgather_base_", "all_gather_into_tensor",
              "all_gather_into_tensor_out"}


def balanced_counts(copies: int, experts: int) -> Tensor:
    """``[experts]`` copies per expert when ``copies`` are spread evenly: ``copies // experts`` each, the first
    ``copies % experts`` experts one more.

    Args:
        copies: token copies routed (tokens x top-k).
        experts: experts of the layer (``bincount``'s ``minlength``).
    """
    counts = torch.full((experts,), copies // experts, dtype=torch.long)
    counts[: copies % experts] += 1
    return counts


def _mixes(tensors: list[Tensor]) -> bool:
    devices = {t.device.type for t in tensors if t.dim() > 0}
    return "meta" in devices and "cpu" in devices


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor) and value.device.type == "cpu" and value.dim() > 0:
        return value.to("meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(item) for item in value)
    return value


class BalancedRouting(_compat.dispatch_mode()):  # type: ignore[misc]
    """Inside, an MoE layer's counts on ``meta`` are those of balanced routing (module docstring).

    Attributes:
        routed: token copies whose counts were given (``bincount`` on ``meta``), for the step's notes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.routed = 0

    def details(self) -> dict[str, Any]:
        """The step's figure for its notes: token copies routed with given counts (none: an empty dict)."""
        return {"balanced_routing_copies": self.routed} if self.routed else {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _aten.bincount.default and args[0].device.type == "meta":
            if len(args) > 1 and args[1] is not None or kwargs.get("weights") is not None:
                raise NotImplementedError("bincount with weights on meta tensors: lp-simulate gives counts only")
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            self.routed += args[0].numel()
            return balanced_counts(args[0].numel(), max(int(minlength), 1))
        if _masks_meta(func, args):
            raise NotImplementedError("a boolean mask over meta tensors (MoE capacity dropping: which copies an expert "
                                      "keeps) has no size without values")
        tensors = [t for t in leaves((args, kwargs)) if isinstance(t, Tensor)]
        if func is _compat.grouped_mm_operator() and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
            # torch's meta rule for the grouped GEMM is CUDA's (bf16 only); the CPU kernel a real run takes also
            # multiplies fp32: the same shapes, asked of the rule in bf16
            dtype = args[0].dtype
            args = tuple(a.to(torch.bfloat16) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
            return self.__torch_dispatch__(func, types, args, kwargs).to(dtype)
        if _mixes(tensors):
            if func.overloadpacket is _aten.repeat_interleave and isinstance(args[1], Tensor):
                kwargs["output_size"] = int(args[1].sum())
            args, kwargs = _to_meta(args), {k: _to_meta(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional") and func.overloadpacket.__name__ in _SYMMETRIC:
            _fill_symmetric(func.overloadpacket.__name__, args, out)
        return out


def _masks_meta(func: Any, args: tuple) -> bool:
    """Whether ``func`` selects by a boolean ``meta`` mask (its output's size is the mask's count of true values)."""
    if func in (_aten.nonzero.default, _aten.masked_select.default):
        return args[0].device.type == "meta"
    if func is _aten.index.Tensor:
        return any(isinstance(i, Tensor) and i.dtype == torch.bool and i.device.type == "meta" for i in args[1])
    return False


def _fill_symmetric(name: str, args: tuple, out: Any) -> None:
    """What the fake world's collective left unfilled: every rank sent what this rank sent (counts on CPU only)."""
    if name == "alltoall_base_":
        output, source = args[0], args[1]
        targets = [output]
    elif name in ("allgather_",):
        targets, source = [t for group in args[0] for t in group], args[1][0]
    elif name == "_allgather_base_":
        output, source = args[0], args[1]
        targets = list(output.view(-1, *source.shape).unbind(0))
    else:
        return
    if source.device.type != "cpu":
        return
    with torch.no_grad():
        for target in targets:
            if target.device.type == "cpu" and target.numel() == source.numel():
                target.copy_(source.view_as(target))
