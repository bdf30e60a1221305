"""Fault tolerance as one object the hybrid strategy calls at each of its hooks, present or not.

The strategy calls the same six hooks on every run; without fault tolerance they are :class:`NoReplicas`'s
pass-throughs, so the lifecycle reads without a branch per hook. With it they are
:class:`~lightning_parallel.fault_tolerance.replicas.ReplicaGroups` (torchft): the first quorum in ``setup``, the
loader positioned by the group's place in the global batch, the sampler over every group's ranks, the quorum before
each forward, the close at teardown; its gradient average and commit run among the after-backward steps.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.optim import Optimizer

from lightning_parallel.fault_tolerance.replicas import ReplicaGroups

__all__ = ["NoReplicas", "replica_hooks"]


class NoReplicas:
    """The hooks of a run without replica groups: each leaves what it is given as it is."""

    def open(self, strategy: Any, trainer: Any, optimizers: list[Optimizer]) -> None:
        """Nothing to join."""

    def position_loader(self, loader: Any) -> Any:
        """The loader unchanged."""
        return loader

    def sampler_kwargs(self, inner: dict[str, int]) -> dict[str, int]:
        """Lightning's sampler arguments unchanged."""
        return inner

    def before_forward(self, batch_idx: int) -> None:
        """No quorum to ask."""

    def close(self) -> None:
        """Nothing to leave."""


def replica_hooks(groups: Optional[ReplicaGroups]) -> Any:
    """``groups`` itself (it has every hook), or :class:`NoReplicas` without fault tolerance.

    Args:
        groups: the strategy's replica groups, or None.
    """
    return NoReplicas() if groups is None else groups
