"""Bytes per rank of a candidate layout: parameters, gradients, optimizer state, activations.

The sharding formulas are the ones ``benchmarks/memory_per_rank.py`` checks byte for byte
against real runs of the hybrid strategy:

* a pipeline rank holds the layers of its stages, cut by the same balanced partition the
  strategy uses (:func:`lightning_parallel.parallel.pipeline.partition.balanced_partition` over the
  layers' parameter counts) and placed by the schedule's stage-to-rank mapping;
* tensor parallelism divides the dimension the plan shards;
* context parallelism divides the activations: a context rank holds ``1 / cp`` of every sequence's
  tokens and saves only their activations (its parameters are replicated over the context group);
* FSDP2 (``zero_stage`` 2 and 3) cuts each parameter's first dimension (as left by tensor
  parallelism) into ``dp x cp`` chunks (``torch.chunk``: the first rank holds the rounded-up chunk), the
  ranks holding the same parameters;
  gradients are sharded like parameters and AdamW holds two states per local element;
* DeepSpeed shards the flat optimizer state (stage 1), also gradients (2), also parameters (3)
  in ``dp`` equal parts;
* expert parallelism (``ep > 1``) keeps ``E / ep`` experts of every MoE module on a rank, whole: FSDP2
  leaves them out, so ZeRO does not shard them over the expert-data group (the current implementation;
  :mod:`lightning_parallel.planner.experts`), and they are not in the gathered working copy.

The peak of a rank is the larger of the training step's and the setup's (:func:`setup_bytes`):
a model built with storage (in ``__init__``) is whole on every rank before it is split; one built
on ``meta`` (in ``configure_model``) is materialised share by share.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.shapes import ModelShape


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded rank.

    Args:
        params: parameters at rest. grads: gradients. optim: optimizer state.
        activations: saved for backward at the peak of the step.
        working: gathered parameters while a sharded layer computes (FSDP2 / ZeRO-3).
        setup: the peak while the model is built and split, before the first step (:func:`setup_bytes`).
    """

    params: float
    grads: float
    optim: float
    activations: float
    working: float = 0.0
    setup: float = 0.0

    @property
    def states(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optim

    @property
    def training(self) -> float:
        """The training step's peak: states, activations and gathered parameters."""
        return self.states + self.activations + self.working

    @property
    def total(self) -> float:
        """The rank's peak: the larger of the training step's and the setup's."""
        return max(self.training, self.setup)


@lru_cache(maxsize=1024)
def _stage_layers(counts: tuple[int, ...], schedule: str, pp: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    from lightning_parallel.parallel.pipeline.partition import balanced_partition
    from lightning_parallel.parallel.pipeline.schedules import stage_ids_for_rank

    bounds = balanced_partition(counts, pp * v)
    return tuple(tuple(tuple(range(bounds[s], bounds[s + 1])) for s in stage_ids_for_rank(schedule, r, pp, v))
                 for r in range(pp))


def stage_layers(shape: ModelShape, c: Candidate) -> list[list[list[int]]]:
    """For each pipeline rank, the layer indices of each of its stages."""
    if c.pp == 1:
        return [[list(range(len(shape.layers)))]]
    placed = _stage_layers(tuple(shape.parameter_counts()), c.schedule, c.pp, c.stages_per_rank)
    return [[list(stage) for stage in rank] for rank in placed]


def _flat_share(numel: int, c: Candidate, stage: int) -> int:
    """DeepSpeed's flat partition of ``numel`` elements over ``dp`` ranks from ZeRO stage ``stage`` on."""
    return -(-numel // c.dp) if c.engine == "deepspeed" and c.zero >= stage else numel


def state_bytes(shape: ModelShape, c: Candidate, layers: list[int]) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes of ``layers`` on one rank."""
    b = shape.param_bytes
    if c.engine == "deepspeed":
        total = sum(shape.layers[i].num_params for i in layers)
        return (
            b * _flat_share(total, c, 3),
            b * _flat_share(total, c, 2),
            shape.optimizer_states * b * _flat_share(total, c, 1),
        )
    fsdp = c.replicas if c.zero in (2, 3) else 1
    counts = shape.local_counts(c.tp, fsdp, c.ep, c.replicas // c.ep if c.expert_shard else 1)
    local = sum(counts[i][1] for i in layers)
    # Adam's step counter: one scalar per parameter tensor, sharded or not (lp-simulate measures it).
    steps = shape.step_bytes * sum(len(shape.layers[i].params) for i in layers) if shape.optimizer_states else 0
    return b * local, b * local, shape.optimizer_states * b * local + steps


def activation_bytes(shape: ModelShape, c: Candidate, layer: int, samples: int) -> float:
    """Bytes ``layer`` keeps for backward for ``samples`` samples, under the candidate's tensor and context sizes
    and checkpointing.

    Note:
        Everything a layer saves is per token (the attention the shapes describe keeps no ``S x S`` scores:
        flash / SDPA kernels, ring attention's log-sum-exp, Ulysses' local kernel over ``1 / cp`` of the heads),
        so a context rank saves ``1 / cp`` of it. The blocks in flight inside ring attention (a received key/value
        block and, in backward, the dK/dV accumulators) are transient and not modelled.
    """
    s = shape.layers[layer]
    if c.checkpointing == "full":
        return s.output_bytes * samples / c.cp  # the layer's input is kept; its inside is recomputed
    kept = s.activation_sharded / c.tp + s.activation_replicated
    if c.checkpointing == "selective":
        kept *= s.selective_saved if s.selective_saved is not None else 1.0
    return kept * samples / c.cp


def plain_ddp(c: Candidate) -> bool:
    """Whether the hybrid strategy's data axis is torch's DDP (no gathered copy): ZeRO 0 over data (x context) ranks
    with no tensor, pipeline or expert axis (:func:`lightning_parallel.parallel.replicated.replicates_plain`, for
    a full-precision run; a mixed-precision policy keeps FSDP2)."""
    return c.engine == "hybrid" and c.zero == 0 and c.tp == 1 and c.pp == 1 and c.ep == 1


def working_bytes(shape: ModelShape, c: Candidate, layers: list[int]) -> float:
    """Parameters gathered while computing: FSDP2 keeps the rank's layers unsharded from forward to backward
    (ZeRO-2, and replicated data parallelism, which runs on FSDP2 with shard groups of one rank: a second copy
    of the parameters, except where the data axis is torch's DDP: :func:`plain_ddp`); ZeRO-3 (FSDP2 or DeepSpeed)
    gathers a layer and prefetches the next. Experts sharded by
    expert parallelism are not FSDP2's: they are never gathered, unless sharded over their expert-data ranks too
    (``expert_shard``): then one MoE module's ``E / ep`` experts are gathered at a time, and the next prefetched."""
    fsdp = c.replicas > 1 and c.engine == "hybrid" and not plain_ddp(c)
    if not (fsdp or (c.engine == "deepspeed" and c.zero == 3 and c.dp > 1)):
        return 0.0
    counts = shape.local_counts(c.tp, 1)
    experts = shape.expert_counts() if c.ep > 1 else (0,) * len(shape.layers)
    full = [counts[i][0] - experts[i] for i in layers]
    gathered = sum(full) if (fsdp and c.zero in (0, 2)) else 2 * max(full, default=0)  # 2: prefetch
    if c.expert_shard:
        modules = [shape.expert_counts(c.ep)[i] // shape.layers[i].moe_modules for i in layers
                   if shape.layers[i].moe_modules]
        gathered += 2 * max(modules, default=0)
    return shape.param_bytes * gathered


def setup_bytes(shape: ModelShape, c: Candidate, layers: list[int]) -> float:
    """Bytes on one rank while the model is built and split (before any gradient or optimizer state exists).

    Built with storage (``shape.built_on_meta=False``): the whole model, on every rank, before the split
    (the strategy moves it to the device, then cuts and shards it). Built on ``meta``: the rank's share
    (its parameters at rest) plus, where the share is a DTensor (tensor parallelism, or FSDP2 on the data
    axis, ZeRO 2/3 or replicated over several data or context ranks; DeepSpeed ZeRO-3), one parameter at full size:
    :mod:`lightning_parallel.parallel.materialize` initialises one module at a time at full size on the CPU
    and ``distribute_tensor`` copies one of its tensors to the device at full size before slicing it
    (modelled as the largest tensor of the rank's layers). A plain tensor is copied into place directly.
    DeepSpeed below stage 3 holds whole parameters anyway (its at-rest share is the model). Under expert
    parallelism an experts module is initialised whole (every expert of it) before the rank keeps its slice.

    Args:
        shape: the model (``built_on_meta`` says how the run builds it).
        c: the layout.
        layers: the rank's layer indices.
    """
    if not shape.built_on_meta:
        return float(shape.param_bytes * shape.num_params)
    share = state_bytes(shape, c, layers)[0]
    if c.engine == "deepspeed":
        distributed = c.zero == 3 and c.dp > 1
    elif c.engine == "ddp":
        distributed = False  # Lightning's DDP builds the whole model on every rank
    else:
        distributed = c.tp > 1 or c.zero in (2, 3) or c.replicas > 1
    largest = max((p.numel for i in layers for p in shape.layers[i].params), default=0)
    if c.ep > 1:
        experts = [shape.layers[i].expert_params // shape.layers[i].moe_modules for i in layers
                   if shape.layers[i].moe_modules]
        largest = max([largest, *experts])
    return share + (shape.param_bytes * largest if distributed else 0.0)
