"""A pipelined rank's step on ``meta``: activations of one micro-batch per stage, the micro-batches the schedule
keeps in flight, and the schedule's sends and receives.

torch's pipeline stages infer their shapes by exchanging objects with real peers, which a fake world has none of, so
the schedule itself does not run here. Instead each of the rank's stages runs forward and backward of one micro-batch
on ``meta``: the first stage on the batch's first micro-batch (its ``stage_arguments``), a later stage on the output
its predecessor gave when the pipeline position holding it was simulated (positions are simulated in order and leave
their stages' outputs in a mailbox the simulation shares; a stage whose predecessor is simulated later -- interleaved
and V schedules -- takes the first boundary's shape, which decoders keep between every pair of stages). The
schedule's action list (torch's, :func:`lightning_parallel.planner.schedule_sim.rank_orders`) then says how many
micro-batches of each stage are held at once: the rank's activation peak is the largest sum over its stages of
micro-batches in flight times that stage's bytes per micro-batch.

Note:
    Collectives inside a stage (FSDP2, tensor parallelism) are not counted for pipelined layouts; only the schedule's
    point-to-point transfers are: per micro-batch, the boundary's activations forward and their gradients backward,
    between stages on different pipeline ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.planner.simulation.routing import BalancedRouting
from lightning_parallel.planner.simulation.step import StepRecord, _SavedTensors, fused_attention


def micro_batch(batch: Any, count: int) -> Any:
    """The first of ``count`` micro-batches of ``batch`` (every tensor cut along dimension 0)."""
    if isinstance(batch, Tensor):
        return batch[: batch.shape[0] // count]
    if isinstance(batch, Mapping):
        return {key: micro_batch(value, count) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(micro_batch(value, count) for value in batch)
    return batch


def run_pipeline_step(done: Any, batch: Any, mailbox: dict[int, Tensor], position: int) -> StepRecord:
    """Stage by stage forward and backward of one micro-batch, scaled by the schedule (the module docstring).

    Args:
        done: what ``parallelize`` returned for this rank (its stages, ids, options, adapter, loss).
        batch: this rank's batch on ``meta`` (before micro-batching and context splitting).
        mailbox: stage id -> its output on ``meta``, shared by the ranks of one simulation.
        position: this rank's pipeline position.
    """
    from lightning_parallel.planner.schedule_sim import rank_orders

    options = done.options
    micro = micro_batch(batch, options.microbatches)
    if done.context_split is not None:
        micro = done.context_split.split_batch(micro)
    inputs, targets = done.adapter.split_batch(micro)
    arguments = getattr(done.stages[0], "stage_arguments", None)
    args, kwargs = arguments(inputs) if arguments is not None else ((inputs,), {})
    per_stage: dict[int, int] = {}
    for module, stage in zip(done.stages, done.stage_ids):
        stage_args = args if stage == 0 else (_boundary(mailbox, stage),)
        per_stage[stage] = _stage_step(module, stage, done, stage_args, kwargs, targets, mailbox)
    orders = rank_orders(options.schedule, done.num_stages // options.stages_per_rank, options.stages_per_rank,
                         options.microbatches)
    peak, in_flight = _in_flight(orders[position], per_stage)
    calls = _transfers(orders, position, done.stage_ids, done.num_stages, mailbox, options.microbatches)
    return StepRecord(tuple(calls), peak, {"activation_bytes_per_microbatch": per_stage,
                                           "microbatches_in_flight": in_flight})


def _boundary(mailbox: dict[int, Tensor], stage: int) -> Tensor:
    """The input of ``stage``: its predecessor's output, else the first boundary's shape (the module docstring)."""
    found = mailbox.get(stage - 1, mailbox.get(min(mailbox)) if mailbox else None)
    if found is None:
        raise ValueError(f"stage {stage}'s input is unknown: simulate pipeline position 0 first (lp-simulate does).")
    return torch.empty_like(found, device="meta").requires_grad_(found.is_floating_point())


def _stage_step(module: nn.Module, stage: int, done: Any, args: tuple, kwargs: dict, targets: Any,
                mailbox: dict[int, Tensor]) -> int:
    """Forward and backward of one micro-batch through ``module``; the bytes its forward saved."""
    from lightning_parallel import _compat
    from lightning_parallel.parallel.tensor.plan import loss_parallel_context

    saved = _SavedTensors(module, selective=done.options.activation_checkpointing == "selective")
    last = stage == done.num_stages - 1
    parallel_loss = loss_parallel_context(True) if last and done.options.loss_parallel else nullcontext()
    with _compat.fsdp2_step_on_meta(module), _compat.hf_masks_on_meta(), fused_attention(), BalancedRouting():
        with parallel_loss:
            # The last stage's loss is part of its forward, as in the schedule: what the loss saves for backward
            # (the log-probabilities, as large as the logits) is held with the micro-batch until its backward.
            with saved.counting():
                output = module(*args, **kwargs)
                loss = done.loss_fn(output, targets) if last else None
            first = output if isinstance(output, Tensor) else next(t for t in output if isinstance(t, Tensor))
            mailbox[stage] = torch.empty_like(first.detach(), device="meta")
            if last:
                loss = loss[0] if isinstance(loss, tuple) else loss
                (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).backward()
            elif first.requires_grad:
                first.backward(torch.empty_like(first))
    return saved.total()


def _in_flight(actions: Any, per_stage: Mapping[int, int]) -> tuple[int, dict[int, int]]:
    """The rank's activation peak under its action list, and the most micro-batches each stage held at once."""
    live = dict.fromkeys(per_stage, 0)
    most = dict.fromkeys(per_stage, 0)
    peak = 0
    for kind, stage, _ in actions:
        if stage not in live:
            continue
        live[stage] += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
        most[stage] = max(most[stage], live[stage])
        peak = max(peak, sum(live[s] * per_stage[s] for s in live))
    return peak, most


def _transfers(orders: Mapping[int, Any], position: int, stages: tuple[int, ...], num_stages: int,
               mailbox: Mapping[int, Tensor], microbatches: int) -> list[dict[str, Any]]:
    """The schedule's sends and receives of this rank in one step (between stages on different ranks)."""
    owner = {stage: rank for rank, actions in orders.items() for _, stage, _ in actions}
    sizes = {"send": 0, "recv": 0}
    counts = {"send": 0, "recv": 0}
    for stage in stages:
        for neighbour, forward in ((stage + 1, "send"), (stage - 1, "recv")):
            if not 0 <= neighbour < num_stages or owner.get(neighbour) == position:
                continue
            boundary = _boundary(mailbox, max(stage, neighbour))  # what stage min(stage, neighbour) outputs
            nbytes = boundary.numel() * boundary.element_size()
            backward = "recv" if forward == "send" else "send"  # the gradient goes the other way
            for kind in (forward, backward):
                counts[kind] += microbatches
                sizes[kind] += microbatches * nbytes
    return [{"kind": kind, "axis": "pipeline_parallel", "count": counts[kind], "bytes": sizes[kind]}
            for kind in ("send", "recv") if counts[kind]]
