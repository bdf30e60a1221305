"""The work a hybrid step runs after its backward and before clipping and the optimizer: built once per run.

Experts sharded over the expert axis are left out of the data axis's reduction: their gradients (the accumulation
window's sum) are reduced over the expert-data group after the closure's backward, before clipping sees them, and the
first step's expert load is reported then; replica groups (fault tolerance) average after that and commit, so
clipping and the optimizer see the same gradient on every group. The data axis needs nothing here: FSDP2 or DDP
reduced its gradients during the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.layout import EXPERT_DATA
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.experts.sharded import reduce_expert_gradients, rescale_expert_gradients
from lightning_parallel.strategies.hybrid.checkpoints import unwrap_optimizer
from lightning_parallel.strategies.hybrid.expert_load_report import report_first_step_load


class AfterBackward:
    """One piece of after-backward work: called with the module and the (unwrapped) optimizer once the step's
    backward is done; :meth:`after_step` runs once the optimizer step has ended, however it ended."""

    def __call__(self, module: nn.Module, optimizer: Optimizer) -> None:
        raise NotImplementedError

    def after_step(self) -> None:
        """Nothing by default."""


class ReduceExpertGradients(AfterBackward):
    """The experts' gradients summed over the ranks holding the same experts; the first step's load reported.

    Args:
        group: the expert-data group.
        data_context: data x context ranks (the gradients' divisor, as the data axis's average).
        sharded: the experts are sharded over the expert-data group (``expert_data_shard``): FSDP2 reduced their
            gradients during the backward, only the load report is left.
    """

    def __init__(self, group: Any, data_context: int, sharded: bool = False) -> None:
        self.group, self.data_context, self.sharded = group, data_context, sharded

    def __call__(self, module: nn.Module, optimizer: Optimizer) -> None:
        if self.sharded:  # FSDP2 averaged them over the expert-data group in the backward
            rescale_expert_gradients(module, dist.get_world_size(self.group) / self.data_context)
        else:
            reduce_expert_gradients(module, self.group, self.data_context)
        report_first_step_load(module, self.group, module.trainer.global_step)


class CommitReplicas(AfterBackward):
    """Fault tolerance: the gradient average across replica groups and the step's commit vote.

    Args:
        replicas: the run's :class:`~lightning_parallel.fault_tolerance.replicas.ReplicaGroups`.
    """

    def __init__(self, replicas: Any) -> None:
        self.replicas = replicas

    def __call__(self, module: nn.Module, optimizer: Optimizer) -> None:
        self.replicas.reduce_and_commit(module, optimizer)

    def after_step(self) -> None:
        self.replicas.after_step()


def after_backward_steps(meshes: RunMeshes, replicas: Optional[Any], expert_data_shard: bool = False
                         ) -> list[AfterBackward]:
    """The run's after-backward work, in order (the module docstring); empty when a step needs none.

    Args:
        meshes: the run's meshes (its layout says whether experts are sharded).
        replicas: the replica groups, or None without fault tolerance.
        expert_data_shard: ``ParallelOptions.expert_data_shard`` (FSDP2 reduces experts over more than one
            expert-data rank).
    """
    steps: list[AfterBackward] = []
    layout = meshes.layout
    if layout.expert_parallel > 1:
        sharded = expert_data_shard and layout.expert_data > 1
        steps.append(ReduceExpertGradients(meshes.group(EXPERT_DATA), layout.data_context, sharded))
    if replicas is not None:
        steps.append(CommitReplicas(replicas))
    return steps


def step_with(steps: list[AfterBackward], module: nn.Module, optimizer: Any, closure: Callable[[], Any],
              optimizer_step: Callable[[Callable[[], Any]], Any]) -> Any:
    """``optimizer_step(closure)`` with ``steps`` run after the closure's backward; each step's ``after_step`` once
    the optimizer step has ended, however it ended.

    Args:
        steps: the run's after-backward work (:func:`after_backward_steps`).
        module: the LightningModule.
        optimizer: the optimizer being stepped (a ``LightningOptimizer`` is unwrapped for the steps).
        closure: Lightning's closure (forward and backward).
        optimizer_step: Lightning's own step, given the closure to run.
    """
    if not steps:
        return optimizer_step(closure)

    def closure_then_steps() -> Any:
        result = closure()
        for step in steps:
            step(module, unwrap_optimizer(optimizer))
        return result

    try:
        return optimizer_step(closure_then_steps)
    finally:
        for step in steps:
            step.after_step()
