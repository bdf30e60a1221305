"""Predicted step time and memory of one candidate layout.

Step time = accumulation x (pipeline step of one batch, simulated from the schedule's action
lists, with tensor-parallel collectives inside each layer) + the data axis's collectives + the
optimizer step. Collectives use an alpha-beta ring model over the link the group spans
(ranks are placed tensor-innermost, then pipeline, then data: :mod:`lightning_parallel.layout`):

* all-reduce of ``B`` bytes over ``n`` ranks: ``2(n-1) (alpha + B / (n beta))``;
* all-gather / reduce-scatter of ``B`` (the whole tensor): ``(n-1) (alpha + B / (n beta_gather))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.cluster import Cluster, Link
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

_BUCKET = 25 * 2**20  # parallel/gradients.py's all-reduce bucket


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of a candidate.

    Args:
        candidate: the layout.
        memory: bytes on the most loaded rank.
        step_time: seconds per optimizer step.
        compute: compute seconds per step on the busiest rank (checkpointing recomputation included).
        bubble: idle share of the pipeline step (0 without pipeline).
        comm: seconds of collectives per step that do not overlap compute.
    """

    candidate: Candidate
    memory: Memory
    step_time: float
    compute: float
    bubble: float
    comm: float

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.candidate.global_batch / self.step_time


def all_reduce(link: Link, n: int, nbytes: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) * (link.latency + nbytes / (n * link.bandwidth))


def gather(link: Link, n: int, nbytes: float) -> float:
    return 0.0 if n == 1 else (n - 1) * (link.latency + nbytes / (n * link.gather_bandwidth))


def layer_seconds(
    shape: ModelShape, cluster: Cluster, c: Candidate, micro: int, world: int
) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each layer on one micro-batch of ``micro`` samples.

    Tensor collectives included.
    """
    if cluster.compute == "measured":
        if shape.measured_seconds is None:
            raise ValueError(f"cluster {cluster.name!r} measures compute, but the shape of {shape.name} was not "
                             "measured: plan it from a model config, or use a cluster with compute: peak.")
        totals = list(shape.measured_seconds(micro))
    else:
        totals = [3 * layer.fwd_flops * micro / (cluster.peak_flops * cluster.efficiency) for layer in shape.layers]
    link = cluster.link(c.tp, world)
    out = []
    for layer, total in zip(shape.layers, totals):
        sharded = any(p.tp_dim is not None for p in layer.params)
        fwd, bwd = total / 3, 2 * total / 3
        if sharded and c.tp > 1:
            fwd, bwd = fwd / c.tp, bwd / c.tp
        recompute = (fwd if c.checkpointing == "full"
                     else fwd * layer.recompute_fraction if c.checkpointing == "selective" else 0.0)
        tp_comm = 0.0
        if sharded and c.tp > 1:
            # The volume once each way; every further call its latency.
            calls = max(0, layer.tp_collectives - 2)
            tp_comm = (all_reduce(link, c.tp, layer.tp_all_reduce_bytes * micro)
                       + calls * 2 * (c.tp - 1) * link.latency / 2)
        out.append((fwd + tp_comm, bwd + recompute + tp_comm))
    return out


def _data_axis_seconds(
    c: Candidate, cluster: Cluster, local_bytes: float, full_bytes: float, units: int
) -> tuple[float, float]:
    """(per batch, per optimizer step) seconds of the data axis's collectives for one rank's parameters."""
    link = cluster.link(c.dp * c.pp * c.tp, c.dp * c.pp * c.tp)
    if c.dp == 1:
        return 0.0, 0.0
    if c.engine == "deepspeed":
        per_batch = gather(link, c.dp, full_bytes) * (2 if c.zero == 3 else 0)
        sync = all_reduce(link, c.dp, full_bytes) if c.zero == 1 else 2 * gather(link, c.dp, full_bytes)
        return per_batch, sync
    if c.zero == 0:
        buckets = max(1, int(-(-local_bytes // _BUCKET)))
        return 0.0, all_reduce(link, c.dp, local_bytes) + 2 * (c.dp - 1) * link.latency * (buckets - 1)
    per_unit = (c.dp - 1) * link.latency * units  # one gather and one reduce-scatter per FSDP unit (layer)
    gathers = 2 if c.zero == 3 else 1
    per_batch = gathers * (gather(link, c.dp, full_bytes) + per_unit) + gather(link, c.dp, full_bytes) + per_unit
    return per_batch, 0.0


def _dtensor_params(shape: ModelShape, c: Candidate, layers: list[int]) -> int:
    """DTensor parameter dispatches per step on the rank: every parameter once (optimizer, hooks) under FSDP2 (the
    hybrid strategy's data axis at any ZeRO stage); under tensor parallelism the sharded layers' parameters also
    once per micro-batch (their forward and backward run as DTensor operations)."""
    count = 0
    if c.engine == "hybrid" and c.dp > 1:
        count += sum(len(shape.layers[i].params) for i in layers)
    if c.tp > 1:
        sharded = sum(len(shape.layers[i].params) for i in layers
                      if any(p.tp_dim is not None for p in shape.layers[i].params))
        count += sharded * (c.microbatches * c.accumulate + (0 if count else 1))
    return count


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
    world = c.dp * c.pp * c.tp
    per_rank = stage_layers(shape, c)
    micro = c.batch_size // c.microbatches
    times = layer_seconds(shape, cluster, c, micro, world)
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
        sent = max(shape.layers[s[-1]].output_bytes for s in stages) * micro
        link = cluster.link(c.pp * c.tp, world)
        sim = _simulate(c.schedule, c.pp, c.stages_per_rank, c.microbatches, tuple(fwd), tuple(bwd), tuple(act),
                        link.latency + sent / link.bandwidth)
        batch_time, peaks, busy, bubble = sim.step_time, sim.peak_in_flight, max(sim.busy), sim.bubble
        work = sum(sim.busy) * c.dp * c.tp
    else:
        batch_time, peaks, busy, bubble = fwd[0] + bwd[0], (act[0],), fwd[0] + bwd[0], 0.0
        work = busy * world
    # Processes sharing fewer cores (compute_units) cannot finish before all their work has had a core:
    # a rank idle in the pipeline bubble leaves its core to the others.
    slowdown = cluster.compute_slowdown(world)
    batch_time = max(batch_time, work / (cluster.compute_units or world))
    worst, comm, step, memories = None, 0.0, 0.0, []
    for r, rank_stages in enumerate(per_rank):
        layers = [i for s in rank_stages for i in s]
        params, grads, optim = state_bytes(shape, c, layers)
        full = shape.param_bytes * sum(shape.local_counts(c.tp, 1)[i][0] for i in layers)
        per_batch, sync = _data_axis_seconds(c, cluster, params, full, len(layers))
        optimizer = slowdown * 2 * (params + grads + optim) / cluster.memory_bandwidth
        optimizer += slowdown * cluster.dtensor_param_overhead * _dtensor_params(shape, c, layers)
        rank_step = c.accumulate * (batch_time + per_batch) + sync + optimizer
        if rank_step > step:
            step, comm = rank_step, c.accumulate * per_batch + sync
        memories.append(Memory(params, grads, optim, peaks[r], working_bytes(shape, c, layers),
                               setup_bytes(shape, c, layers)))
    worst = max(memories, key=lambda m: m.total)
    return Prediction(c, worst, step, c.accumulate * busy, bubble, comm)
