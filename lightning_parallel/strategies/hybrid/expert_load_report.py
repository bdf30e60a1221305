"""The experts' load after the first optimizer step, printed once as a start-up table.

Routing decides how evenly the experts work: a router that sends most tokens to a few experts makes their ranks
the step's stragglers (and, with a capacity factor, drops tokens). The first step shows it before a run has spent
its budget: for each MoE layer, the token copies each expert received over the whole global batch (every data
and expert rank, every micro-batch of the step), and the busiest expert's load over the mean. Each
:class:`~lightning_parallel.parallel.experts.sharded.ExpertParallel` adds up the rows its experts receive until
this report has run. Under pipelining, the forward torch runs once to infer the stages' shapes is not counted
(:attr:`ExpertParallel.counts_forward`): the copies add up to the global batch's tokens x top-k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.experts.sharded import ExpertParallel


def _describe(load: Tensor) -> str:
    mean = float(load.mean())
    busiest = int(load.argmax())
    ratio = float(load.max()) / mean if mean > 0 else float("inf")
    return (f"{load.sum():.0f} copies over {load.numel()} experts: min {load.min():.0f}, mean {mean:.1f}, max "
            f"{load.max():.0f} (expert {busiest}); busiest / mean {ratio:.2f}")


def _global_load(layer: ExpertParallel, expert_data_group: Any) -> Tensor:
    """``[E]``: every expert's rows over the expert group (gathered) and the expert-data group (summed)."""
    local = getattr(layer, "first_step_load", None)
    size = layer.end - layer.first
    local = torch.zeros(size) if local is None else local.to("cpu")
    parts = [torch.zeros(size) for _ in range(dist.get_world_size(layer.group))]
    dist.all_gather(parts, local.to(_device(layer)), group=layer.group)
    full = torch.cat([p.to("cpu") for p in parts])
    if expert_data_group is not None and dist.get_world_size(expert_data_group) > 1:
        full = full.to(_device(layer))
        dist.all_reduce(full, group=expert_data_group)
    return full.to("cpu")


def _device(layer: nn.Module) -> torch.device:
    return next(layer.parameters()).device


def report_first_step_load(module: nn.Module, expert_data_group: Any, step: int) -> None:
    """After the run's first optimizer step: the experts' load per MoE layer, printed by global rank 0 as the table
    ``lightning_parallel: expert load, first step``. Every rank calls it at every step (a world collective at step
    0 only: a pipeline rank whose stage holds no MoE layer takes part too).

    Args:
        module: the LightningModule (its sharded expert layers).
        expert_data_group: the ranks holding the same experts (their loads add up), or None.
        step: the optimizer step that just ran (``trainer.global_step`` before it is counted).
    """
    layers = [(name, m) for name, m in module.named_modules() if isinstance(m, ExpertParallel)]
    if step != 0:
        for _, layer in layers:  # a resumed run: nothing to report, nothing more to count
            layer.load_reported, layer.first_step_load = True, None
        return
    rows = []
    for name, layer in layers:
        load = _global_load(layer, expert_data_group)
        layer.load_reported, layer.first_step_load = True, None
        rows.append((name, _describe(load)))
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(rows, gathered if dist.get_rank() == 0 else None, dst=0)  # stages hold other layers
    if dist.get_rank() == 0:
        from lightning_parallel.runtime.console import print_table

        table = dict(row for part in gathered for row in part)
        print_table("lightning_parallel: expert load, first step", sorted(table.items()))
