"""``Strategy.reduce`` without the barrier Lightning puts before every all-reduce.

Lightning's reduction (in ``lightning.fabric.utilities.distributed``, behind every built-in
strategy's ``reduce``) calls ``torch.distributed.barrier`` and then ``all_reduce``. The all-reduce
synchronises the ranks by itself, so the barrier is a second collective per call -- on gloo a round
trip as long as the all-reduce of a scalar -- and a model that reduces in its step pays it every step:
the GPT recipe's token-weighted mean (``GPT.global_token_mean``) went through it on every data-parallel
step (counted: one ``barrier`` beside its ``all_reduce`` in the benchmark's communication table). The
reduction itself is Lightning's, operator for operator: ``mean`` on gloo (no ``AVG``) is a sum divided
by the group size, in place.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor


def reduce_tensor(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
                  ) -> Any:
    """``tensor`` reduced over ``group`` (default: every rank) in place, as Lightning's ``strategy.reduce`` does,
    minus its barrier; anything that is not a tensor, or a run without a process group, is returned as it is.

    Args:
        tensor: the value to reduce.
        group: the process group (None: the world).
        reduce_op: ``"mean"``/``"avg"``, ``"sum"``, ``"max"``, ... or a ``ReduceOp`` (None: sum).
    """
    if not isinstance(tensor, Tensor) or not (dist.is_available() and dist.is_initialized()):
        return tensor
    group = dist.group.WORLD if group is None else group
    divide, op = False, reduce_op if reduce_op is not None else dist.ReduceOp.SUM
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        divide = name == "avg" and dist.get_backend(group) == "gloo"  # gloo has no AVG: sum, then divide
        op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=op, group=group)
    if not divide:
        return tensor
    size = dist.get_world_size(group)
    return tensor.copy_(tensor / size) if not torch.is_floating_point(tensor) else tensor.div_(size)


class ReduceWithoutBarrier:
    """A base for a Lightning strategy (listed before it): ``reduce`` is Lightning's minus its barrier."""

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[dist.ReduceOp, str]] = "mean"
               ) -> Any:
        """``tensor`` reduced over ``group`` (default: every rank); see :func:`reduce_tensor`.

        Args:
            tensor: the value to reduce (anything else is returned as it is).
            group: the process group (None: the world).
            reduce_op: ``"mean"`` (default), ``"sum"``, ``"max"``, ... or a ``ReduceOp``.
        """
        return reduce_tensor(tensor, group, reduce_op)
