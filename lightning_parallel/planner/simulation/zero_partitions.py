"""DeepSpeed ZeRO 0-3 simulated from DeepSpeed's own partition arithmetic: every rank's flat partitions, as stored.

DeepSpeed does not compose torch's parallelisms (nothing to run in a fake world): its engine flattens parameters
and cuts the flat buffers by arithmetic that depends only on the parameters' sizes, their order in the optimizer's
groups, the data-parallel size and its ZeRO config (read with DeepSpeed's own ``DeepSpeedZeroConfig`` defaults).
This module repeats that arithmetic (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
``partition_parameters.py``, ``parameter_offload.py``) for each rank:

- ZeRO 1 and 2: each optimizer group flattened into one buffer of the model's dtype, padded to a multiple of
  ``2 x ranks`` elements and held whole (the parameters are views of it); each rank keeps one ``1 / ranks``
  partition of it as fp32 master weights, and the optimizer's state over that partition. After backward, both stages
  hold the rank's partition of the reduced gradients (in views of DeepSpeed's reduction buffers).
- ZeRO 3: each parameter cut into ``ceil(numel / ranks)`` elements per rank (the last padded), held in one flat
  buffer per sub-group (``sub_group_size`` elements of partitions), fp32 master partitions and optimizer state per
  sub-group, and a flat gradient buffer of the partitions (``gradient_accumulation_dtype``: fp32 here). Parameters of
  at most ``param_persistence_threshold`` elements (while the persistent total stays under
  ``model_persistence_threshold``) stay gathered, whole (padded) on every rank. At a step's peak, DeepSpeed's own
  estimator counts the largest layer's gathered parameters and gradients (``gathered_bytes``); the reduction bucket
  of ``reduce_bucket_size`` elements DeepSpeed allocates with ``contiguous_gradients`` is in the details.
- ZeRO 0: the model, its gradients and the optimizer as they are, on every rank.

Every rank holds partitions of equal size (DeepSpeed pads the last), so the world is one class. The optimizer's state
is the state ``configure_optimizers``'s optimizer creates over the flat fp32 partitions, measured after one step on
``meta``. Precision: ``32-true`` and ``bf16-mixed`` (DeepSpeed's ``torch_autocast``: fp32 parameters, gradients and
state); ``bf16-true`` (bf16 parameters, DeepSpeed's bf16 optimizer) is not simulated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.planner.simulation import held
from lightning_parallel.planner.simulation.result import ClassResult, Simulation

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeed's stage 1/2 flat-buffer alignment per rank (4 bytes of fp16)
NO_STEP_NOTE = ("DeepSpeed ZeRO: bytes from DeepSpeed's partition arithmetic (its engine composes no torch "
                "parallelism to run in a fake world); no step simulated: activations and collectives not measured")


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO config values the partition arithmetic reads (DeepSpeed's defaults unless the run's config sets them).

    Attributes:
        stage: ZeRO stage, 0 to 3.
        param_persistence_threshold: ZeRO 3 keeps parameters of at most this many elements gathered.
        model_persistence_threshold: ... while their total stays at most this.
        sub_group_size: ZeRO 3's elements of partitions per flat fp32 buffer and optimizer step.
        reduce_bucket_size: elements of the reduction bucket.
        contiguous_gradients: whether ZeRO 3 allocates that bucket.
    """

    stage: int
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    sub_group_size: int = 1_000_000_000
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True

    @classmethod
    def of(cls, zero_config: dict[str, Any]) -> ZeroSettings:
        """The settings of a DeepSpeed ``zero_optimization`` block, DeepSpeed's own defaults filling the rest."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        parsed = DeepSpeedZeroConfig(**zero_config)
        return cls(int(parsed.stage), int(parsed.param_persistence_threshold),
                   int(parsed.model_persistence_threshold), int(parsed.sub_group_size),
                   int(parsed.reduce_bucket_size), bool(parsed.contiguous_gradients))


@dataclass
class _Held:
    parameters: int = 0
    gradients: int = 0
    master: int = 0
    partitions: list[tuple[int, int]] = field(default_factory=list)  # (optimizer group, elements) of each flat
    # fp32 partition the optimizer steps on
    gathered: int = 0
    details: dict[str, Any] = field(default_factory=dict)


def simulate_zero(module: nn.Module, world_size: int, settings: ZeroSettings, *, precision: str = "32-true",
                  device_memory: Optional[float] = None) -> Simulation:
    """Every rank's bytes under DeepSpeed ZeRO ``settings.stage`` over ``world_size`` data-parallel ranks.

    Args:
        module: the LightningModule built on ``meta`` (``configure_model`` run), before DeepSpeed wraps it.
        world_size: data-parallel ranks (every rank of a DeepSpeed run).
        settings: the run's ZeRO settings (:meth:`ZeroSettings.of`).
        precision: the Trainer's precision name.
        device_memory: bytes per device to predict the fit against; None: no fit.

    Raises:
        ValueError: a precision the arithmetic does not cover, or more than one optimizer.
    """
    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(f"lp-simulate repeats DeepSpeed's partition arithmetic for 32-true and bf16-mixed (fp32 "
                         f"parameters); precision={precision} (DeepSpeed's bf16/fp16 optimizers) is not simulated.")
    started = time.perf_counter()
    optimizers = held.optimizers_of(module.configure_optimizers())
    if len(optimizers) != 1:
        raise ValueError(f"DeepSpeed takes one optimizer; configure_optimizers returned {len(optimizers)}.")
    groups = [[p for p in group["params"] if p.requires_grad] for group in optimizers[0].param_groups]
    itemsize = max((p.element_size() for group in groups for p in group), default=4)
    if settings.stage == 0:
        found = _zero0(module, optimizers)
    elif settings.stage in (1, 2):
        found = _zero12(groups, world_size, itemsize)
    else:
        found = _zero3(module, groups, world_size, settings, itemsize)
    state = found.details.pop("state", None)
    optimizer = state if state is not None else found.master + _state_over(optimizers[0], found.partitions)
    result = ClassResult(tuple(range(world_size)), f"ZeRO {settings.stage}: every rank holds partitions of equal "
                         "size (DeepSpeed pads the last)", (), found.parameters, found.gradients, optimizer,
                         found.gathered, None, found.parameters + found.gradients + optimizer + found.gathered,
                         notes=(NO_STEP_NOTE,), details={"master_bytes": found.master, **found.details})
    elements = sum(p.numel() for group in groups for p in group)
    return Simulation(world_size, f"deepspeed zero{settings.stage} x{world_size}", [result], device_memory, elements,
                      time.perf_counter() - started, {"strategy": "deepspeed", "zero_stage": settings.stage,
                                                      "precision": precision})


def _zero0(module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> _Held:
    params = [p for p in module.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    held.first_step(module, optimizers)
    return _Held(parameters=nbytes, gradients=nbytes, details={"state": held.optimizer_bytes(optimizers)})


def _zero12(groups: Sequence[Sequence[torch.Tensor]], ranks: int, itemsize: int) -> _Held:
    """Each group one flat buffer padded to ``2 x ranks`` elements, whole on every rank; a ``1 / ranks`` partition."""
    found = _Held()
    alignment = NCCL_START_ALIGNMENT_FACTOR * ranks
    for index, group in enumerate(groups):
        numel = sum(p.numel() for p in group)
        aligned = math.ceil(numel / alignment) * alignment
        partition = aligned // ranks
        found.parameters += aligned * itemsize
        found.master += partition * 4
        found.partitions.append((index, partition))
        # After backward both stages hold this rank's partition of the reduced gradients (DeepSpeed's stage 1 reduces
        # into partitions during backward too), in the model's dtype; the fp32 gradient the optimizer steps on is
        # the same tensor when that dtype is fp32.
        found.gradients += partition * itemsize + (partition * 4 if itemsize != 4 else 0)
    return found


def _zero3(module: nn.Module, groups: Sequence[Sequence[torch.Tensor]], ranks: int, settings: ZeroSettings,
           itemsize: int) -> _Held:
    """Each parameter cut into ``ceil(numel / ranks)`` per rank; sub-groups; persistent small parameters whole."""
    found = _Held()
    for index, group in enumerate(groups):
        for sub_group in _sub_groups([math.ceil(p.numel() / ranks) for p in group], settings.sub_group_size):
            found.partitions.append((index, sum(sub_group)))
    partitioned = sum(numel for _, numel in found.partitions)
    found.parameters = partitioned * itemsize
    found.master = partitioned * 4
    found.gradients = partitioned * 4  # grad_partitions_flat_buffer, in gradient_accumulation_dtype (fp32)
    persistent = _persistent(module, settings)
    found.parameters += sum(math.ceil(n / ranks) * ranks for n in persistent) * itemsize
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    found.gathered = 2 * largest * itemsize  # DeepSpeed's estimator: the largest layer's parameters and gradients
    found.details.update(persistent_parameters=len(persistent), sub_groups=len(found.partitions),
                         reduce_bucket_bytes=settings.reduce_bucket_size * 4 if settings.contiguous_gradients else 0)
    return found


def _sub_groups(partition_numels: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """DeepSpeed's ``_create_fp16_sub_groups``: partitions accumulated until ``sub_group_size`` elements or the end."""
    if sub_group_size >= sum(partition_numels):
        return [list(partition_numels)]
    groups, current, size = [], [], 0
    for index, numel in enumerate(partition_numels):
        current.append(numel)
        size += numel
        if size >= sub_group_size or index == len(partition_numels) - 1:
            groups.append(current)
            current, size = [], 0
    return groups


def _persistent(module: nn.Module, settings: ZeroSettings) -> list[int]:
    """Numels of the parameters ZeRO 3 keeps gathered (``mark_persistent_parameters``, in module order)."""
    kept, total = [], 0
    for _, param in module.named_parameters():
        numel = param.numel()
        if numel + total > settings.model_persistence_threshold:
            continue
        if numel <= settings.param_persistence_threshold:
            kept.append(numel)
            total += numel
    return kept


def _state_over(optimizer: torch.optim.Optimizer, partitions: Sequence[tuple[int, int]]) -> int:
    """The state ``optimizer``'s class creates over flat fp32 partitions (``(its group, elements)``: one per group or
    sub-group, each with its group's settings), measured after one step on ``meta``."""
    flats = [nn.Parameter(torch.empty(numel, device="meta")) for _, numel in partitions]
    fresh = type(optimizer)([{**{k: v for k, v in optimizer.param_groups[index].items() if k != "params"},
                              "params": [flat]} for (index, _), flat in zip(partitions, flats)])
    for flat in flats:
        flat.grad = torch.zeros_like(flat)
    fresh.step()
    return held.optimizer_bytes([fresh])
