"""Predicted step time and memory of one candidate layout.

Step time = accumulation x (pipeline step of one batch, simulated from the schedule's action
lists, with tensor-parallel and context-parallel collectives inside each layer) + the data axis's
collectives + the optimizer step. A context rank computes ``1 / cp`` of every sequence's tokens
(head-tail chunks balance the causal attention) and its attention modules send what
:mod:`lightning_parallel.planner.context` counts. Collectives use an alpha-beta ring model over the
link the group spans (ranks are placed tensor-innermost, then pipeline, then context, then data:
:mod:`lightning_parallel.layout`); the data axis's collectives run over data x context (the ranks
holding the same parameters). Under expert parallelism each MoE module's all-to-alls
(:mod:`lightning_parallel.planner.experts`) sit inside the layer's time, and the experts' gradients are
all-reduced over the expert-data group once per optimizer step instead of over data x context:

* all-reduce of ``B`` bytes over ``n`` ranks: ``2(n-1) (alpha + B / (n beta))``;
* all-gather / reduce-scatter of ``B`` (the whole tensor): ``(n-1) (alpha + B / (n beta_gather))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_parallel.planner import experts as expert_axis
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.cluster import Cluster, Link
from lightning_parallel.planner.context import Traffic, traffic
from lightning_parallel.planner.memory import (
    Memory,
    activation_bytes,
    setup_bytes,
    stage_layers,
    state_bytes,
    working_bytes,
)
from lightning_parallel.planner.schedule_sim import Simulated, rank_orders, simulate
from lightning_parallel.planner.shapes import ModelShape

_BUCKET = 25 * 2**20  # parallel/grad_norm_clipping.py's all-reduce bucket


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of a candidate.

    Args:
        candidate: the layout.
        memory: bytes on the most loaded rank.
        step_time: seconds per optimizer step.
        compute: compute seconds per step on the busiest rank (checkpointing recomputation included).
        bubble: idle share of the pipeline step (0 without pipeline).
        comm: seconds of collectives per step that do not overlap compute (the data axis's).
        context_bytes: bytes the busiest rank sends per optimizer step in context-parallel collectives
            (ring send/recv or all-to-all; 0 without context parallelism).
        context_comm: seconds of those collectives per step (inside ``step_time``, on the busiest rank).
        expert_bytes: bytes the busiest rank sends per optimizer step in expert-parallel all-to-alls (token
            dispatch and combine, forward and backward; 0 without expert parallelism).
        expert_comm: seconds of those all-to-alls per step (inside ``step_time``).
    """

    candidate: Candidate
    memory: Memory
    step_time: float
    compute: float
    bubble: float
    comm: float
    context_bytes: float = 0.0
    context_comm: float = 0.0
    expert_bytes: float = 0.0
    expert_comm: float = 0.0

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.candidate.global_batch / self.step_time


def all_reduce(link: Link, n: int, nbytes: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def gather(link: Link, n: int, nbytes: float) -> float:
    return 0.0 if n == 1 else (n - 1) * (link.latency + nbytes / (n * link.gather_bandwidth))


def context_traffic(shape: ModelShape, cluster: Cluster, c: Candidate, micro: int) -> Traffic:
    """One attention module's context collectives on one micro-batch of ``micro`` samples (zeros without)."""
    if c.cp == 1 or shape.attention is None:
        return Traffic(0.0, 0.0, 0.0, 0.0)
    link = cluster.link(c.cp * c.pp * c.tp, c.world)
    return traffic(shape.attention, c.cp_method, c.cp, c.tp, micro, link)


def expert_traffic(shape: ModelShape, cluster: Cluster, c: Candidate, micro: int) -> Traffic:
    """One MoE module's all-to-alls on one micro-batch of ``micro`` samples (zeros without expert parallelism)."""
    if c.ep == 1 or shape.experts is None:
        return Traffic(0.0, 0.0, 0.0, 0.0)
    link = cluster.link(c.ep * c.pp * c.tp, c.world)
    return expert_axis.traffic(shape.experts, c.ep, micro * shape.experts.tokens_per_sample / c.cp, link)


def _recomputes(c: Candidate) -> bool:
    """Whether the forward runs again in backward (its context messages too)."""
    return c.checkpointing in ("full", "selective")


def layer_seconds(
    shape: ModelShape, cluster: Cluster, c: Candidate, micro: int, world: int
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each layer on one micro-batch of ``micro`` samples.

    Tensor, context and expert collectives included; a context rank computes ``1 / cp`` of the tokens; tensor
    parallelism does not divide the experts' share of a layer.
    """
    if cluster.compute == "measured":
        if shape.measured_seconds is None:
            raise ValueError(f"cluster {cluster.name!r} measures compute, but the shape of {shape.name} was not "
                             "measured: plan it from a model config, or use a cluster with compute: peak.")
        totals = list(shape.measured_seconds(micro))
    else:
        totals = [3 * layer.fwd_flops * micro / (cluster.peak_flops * cluster.efficiency) for layer in shape.layers]
    link = cluster.link(c.tp, world)
    context = context_traffic(shape, cluster, c, micro)
    experts = expert_traffic(shape, cluster, c, micro)
    out = []
    for index, (layer, total) in enumerate(zip(shape.layers, totals)):
        sharded = any(p.tp_dim is not None for p in layer.params)
        fwd, bwd = total / (3 * c.cp), 2 * total / (3 * c.cp)
        if sharded and c.tp > 1:
            share = expert_axis.expert_flops_share(shape, index)
            fwd, bwd = (fwd * (1 - share) / c.tp + fwd * share), (bwd * (1 - share) / c.tp + bwd * share)
        recompute = (fwd if c.checkpointing == "full"
                     else fwd * layer.recompute_fraction if c.checkpointing == "selective" else 0.0)
        tp_comm = 0.0
        if sharded and c.tp > 1:
            # The volume once each way; every further call its latency.
            calls = max(0, layer.tp_collectives - 2)
            tp_comm = (all_reduce(link, c.tp, layer.tp_all_reduce_bytes * micro / c.cp)
                       + calls * 2 * (c.tp - 1) * link.latency / 2)
        token_fwd, token_bwd = 0.0, 0.0
        for n, t in ((layer.attention_modules, context), (layer.moe_modules, experts)):
            token_fwd += n * t.forward_seconds
            token_bwd += n * (t.backward_seconds + (t.forward_seconds if _recomputes(c) else 0.0))
        out.append((fwd + tp_comm + token_fwd, bwd + recompute + tp_comm + token_bwd))
    return out


def context_bytes_per_step(
    shape: ModelShape, cluster: Cluster, c: Candidate, layers: list[int]
) -> tuple[float, float]:
    """(bytes, seconds) of context collectives one rank holding ``layers`` sends per optimizer step."""
    micro = c.batch_size // c.microbatches
    context = context_traffic(shape, cluster, c, micro)
    modules = sum(shape.layers[i].attention_modules for i in layers)
    passes = 2 if _recomputes(c) else 1
    per_micro_bytes = modules * (passes * context.forward_bytes + context.backward_bytes)
    per_micro_seconds = modules * (passes * context.forward_seconds + context.backward_seconds)
    micros = c.microbatches * c.accumulate
    return per_micro_bytes * micros, per_micro_seconds * micros


def expert_bytes_per_step(
    shape: ModelShape, cluster: Cluster, c: Candidate, layers: list[int]
) -> tuple[float, float]:
    """(bytes, seconds) of expert all-to-alls one rank holding ``layers`` sends per optimizer step."""
    experts = expert_traffic(shape, cluster, c, c.batch_size // c.microbatches)
    modules = sum(shape.layers[i].moe_modules for i in layers)
    passes = 2 if _recomputes(c) else 1
    micros = c.microbatches * c.accumulate
    return (modules * micros * (passes * experts.forward_bytes + experts.backward_bytes),
            modules * micros * (passes * experts.forward_seconds + experts.backward_seconds))


def _expert_sync(shape: ModelShape, cluster: Cluster, c: Candidate, layers: list[int]) -> tuple[float, float, float]:
    """``(expert parameter bytes on the rank, their whole size, seconds of their gradient all-reduce over the
    expert-data group)``; zeros without expert parallelism (the experts are then ordinary parameters)."""
    if c.ep == 1:
        return 0.0, 0.0, 0.0
    local = shape.param_bytes * sum(shape.expert_counts(c.ep)[i] for i in layers)
    whole = shape.param_bytes * sum(shape.expert_counts()[i] for i in layers)
    seconds = all_reduce(cluster.link(c.world, c.world), c.replicas // c.ep, local)
    if c.expert_shard:  # FSDP2: a reduce-scatter and two all-gathers (forward, backward) where an all-reduce is one
        edp = c.replicas // c.ep
        return local / edp, whole, 1.5 * seconds  # local: at rest (the ``params`` it is taken from are sharded)
    return local, whole, seconds


def _rank_data_axis(shape: ModelShape, cluster: Cluster, c: Candidate, layers: list[int],
                    params: float) -> tuple[float, float]:
    """(per batch, per optimizer step) seconds of one rank's gradient collectives: the data axis's over its dense
    parameters (``params`` bytes at rest, experts included), the expert-data group's over its experts."""
    full = shape.param_bytes * sum(shape.local_counts(c.tp, 1)[i][0] for i in layers)
    experts_local, experts_whole, expert_sync = _expert_sync(shape, cluster, c, layers)
    per_batch, sync = _data_axis_seconds(c, cluster, params - experts_local, full - experts_whole, len(layers))
    return per_batch, sync + expert_sync


def _data_axis_seconds(
    c: Candidate, cluster: Cluster, local_bytes: float, full_bytes: float, units: int
) -> tuple[float, float]:
    """(per batch, per optimizer step) seconds of the data axis's collectives for one rank's parameters."""
    link = cluster.link(c.world, c.world)
    n = c.replicas  # data x context: the ranks holding the same parameters
    if n == 1:
        return 0.0, 0.0
    if c.engine == "deepspeed":
        per_batch = gather(link, c.dp, full_bytes) * (2 if c.zero == 3 else 0)
        sync = all_reduce(link, c.dp, full_bytes) if c.zero == 1 else 2 * gather(link, c.dp, full_bytes)
        return per_batch, sync
    if c.zero == 0:
        buckets = max(1, int(-(-local_bytes // _BUCKET)))
        return 0.0, all_reduce(link, n, local_bytes) + 2 * (n - 1) * link.latency * (buckets - 1)
    if c.units_mb:  # ZeRO 2 in units of layers (strategy.bucket_size_mb): units fill up to that size
        units = max(1, min(units, int(-(-full_bytes // (c.units_mb * 2**20)))))
    per_unit = (n - 1) * link.latency * units  # one gather and one reduce-scatter per FSDP unit
    gathers = 2 if c.zero == 3 else 1
    per_batch = gathers * (gather(link, n, full_bytes) + per_unit) + gather(link, n, full_bytes) + per_unit
    return per_batch, 0.0


def _dtensor_params(shape: ModelShape, c: Candidate, layers: list[int]) -> int:
    """DTensor parameter dispatches per step on the rank: every parameter once (optimizer, hooks) under FSDP2 (the
    hybrid strategy's data x context axis, but for ZeRO 0 without other axes, which is DDP on plain tensors:
    ``parallel/replicated.py``); under tensor parallelism the sharded layers' parameters also once per micro-batch
    (their forward and backward run as DTensor operations)."""
    count = 0
    plain = c.zero == 0 and c.tp == 1 and c.pp == 1 and c.ep == 1
    if c.engine == "hybrid" and c.replicas > 1 and not plain:
        count += sum(len(shape.layers[i].params) for i in layers)
    if c.tp > 1:
        sharded = sum(len(shape.layers[i].params) for i in layers
                      if any(p.tp_dim is not None for p in shape.layers[i].params))
        count += sharded * (c.microbatches * c.accumulate + (0 if count else 1))
    return count


def _optimizer_seconds(shape: ModelShape, cluster: Cluster, c: Candidate, layers: list[int], states: float) -> float:
    """The optimizer step's seconds on a rank at full speed: its ``states`` bytes read and written, the DTensor
    dispatch of its parameters, and DeepSpeed's engine per byte of the replica."""
    seconds = 2 * states / cluster.memory_bandwidth + cluster.dtensor_param_overhead * _dtensor_params(shape, c, layers)
    if c.engine == "deepspeed":
        seconds += cluster.deepspeed_overhead_per_byte * shape.param_bytes * sum(shape.layers[i].num_params
                                                                                for i in layers)
    return seconds


@lru_cache(maxsize=4096)
def _simulate(schedule: str, pp: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
              act: tuple[float, ...], transfer: float) -> Simulated:
    """One simulation per schedule and stage costs (layouts differing only in ZeRO stage share it)."""
    return simulate(rank_orders(schedule, pp, v, m), fwd, bwd, act, transfer)


def predict(shape: ModelShape, cluster: Cluster, c: Candidate) -> Prediction:
    """Memory and step time of candidate ``c`` for ``shape`` on ``cluster``.

    Args:
        shape: the model.
        cluster: the machines.
        c: the layout.
    """
    per_rank, micro = stage_layers(shape, c), c.batch_size // c.microbatches
    times = layer_seconds(shape, cluster, c, micro, c.world)
    stages = [stage for rank in per_rank for stage in rank]
    order = sorted(range(len(stages)), key=lambda i: stages[i][0])
    stages = [stages[i] for i in order]
    fwd = [sum(times[i][0] for i in s) for s in stages]
    bwd = [sum(times[i][1] for i in s) for s in stages]
    act = [sum(activation_bytes(shape, c, i, micro) for i in s) for s in stages]
    if c.pp > 1:
        # Every schedule action also pays the runner's dispatch and its send/recv bookkeeping.
        fwd = [f + cluster.pipeline_action_overhead for f in fwd]
        bwd = [b + cluster.pipeline_action_overhead for b in bwd]
        sent = max(shape.layers[s[-1]].output_bytes for s in stages) * micro / c.cp
        link = cluster.link(c.pp * c.tp, c.world)
        sim = _simulate(c.schedule, c.pp, c.stages_per_rank, c.microbatches, tuple(fwd), tuple(bwd), tuple(act),
                        link.latency + sent / link.bandwidth)
        batch_time, peaks, busy, bubble = sim.step_time, sim.peak_in_flight, max(sim.busy), sim.bubble
        work = sum(sim.busy) * c.dp * c.cp * c.tp
    else:
        batch_time, peaks, busy, bubble = fwd[0] + bwd[0], (act[0],), fwd[0] + bwd[0], 0.0
        work = busy * c.world
    # Processes sharing fewer cores (compute_units) cannot finish before all their work has had a core:
    # a rank idle in the pipeline bubble leaves its core to the others.
    slowdown = cluster.compute_slowdown(c.world)
    batch_time = max(batch_time, work / (cluster.compute_units or c.world))
    comm, step, memories = 0.0, 0.0, []
    for r, rank_stages in enumerate(per_rank):
        layers = [i for s in rank_stages for i in s]
        params, grads, optim = state_bytes(shape, c, layers)
        per_batch, sync = _rank_data_axis(shape, cluster, c, layers, params)
        optimizer = slowdown * _optimizer_seconds(shape, cluster, c, layers, params + grads + optim)
        rank_step = c.accumulate * (batch_time + per_batch) + sync + optimizer
        if rank_step > step:
            step, comm = rank_step, c.accumulate * per_batch + sync
        memories.append(Memory(params, grads, optim, peaks[r], working_bytes(shape, c, layers),
                               setup_bytes(shape, c, layers)))
    worst = max(memories, key=lambda m: m.total)
    held = [[i for s in rank for i in s] for rank in per_rank]
    context, experts = (max(f(shape, cluster, c, layers) for layers in held)
                        for f in (context_bytes_per_step, expert_bytes_per_step))
    return Prediction(c, worst, step, c.accumulate * busy, bubble, comm, *context, *experts)
