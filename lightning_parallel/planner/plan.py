"""Rank the candidate layouts: predict each, refuse those that do not fit, sort by predicted throughput.

:func:`overrides` turns a candidate into the ``lp-train`` overrides that run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.planner.candidates import Candidate, Rejected, SearchSpace, Workload, enumerate_layouts
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.predict import Prediction, predict
from lightning_parallel.planner.shapes import ModelShape

_GB = 1e9


@dataclass(frozen=True)
class Plan:
    """The outcome of planning.

    Args:
        shape: the model planned for. cluster: the machines. world: processes.
        ranked: predictions of the layouts that fit, fastest first.
        rejected: layouts that cannot run or do not fit, with the reason.
    """

    shape: ModelShape
    cluster: Cluster
    world: int
    ranked: tuple[Prediction, ...]
    rejected: tuple[Rejected, ...]

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            reasons = sorted({r.reason.split(":")[0] for r in self.rejected})  # the categories, not every detail
            raise ValueError(f"No layout of {self.world} devices runs {self.shape.name} on {self.cluster.name}: "
                             f"every candidate was refused ({'; '.join(reasons)}). Use more devices, a cluster with "
                             "more memory per device, a smaller batch, or activation checkpointing.")
        return self.ranked[0]


def make_plan(shape: ModelShape, cluster: Cluster, world: int, work: Workload,
              space: SearchSpace = SearchSpace()) -> Plan:
    """Enumerate, predict and rank every layout of ``world`` devices.

    Args:
        shape: the model.
        cluster: the machines.
        world: processes in the run.
        work: the configured batch and scaling rule.
        space: the settings to try besides the sizes.
    """
    candidates, rejected = enumerate_layouts(shape, world, work, space)
    ranked = []
    for c in candidates:
        p = predict(shape, cluster, c)
        if p.memory.total > cluster.memory_per_device:
            rejected.append(Rejected(c.name, _does_not_fit(p, shape, cluster), kind="memory"))
        else:
            ranked.append(p)
    # Ties (equal predictions) go to the simpler layout: fewer axes in use, lower ZeRO stage, per-layer units, no
    # checkpointing.
    ranked.sort(key=lambda p: (-float(f"{p.throughput:.9g}"),
                               p.candidate.cp * p.candidate.pp * p.candidate.tp * p.candidate.ep,
                               p.candidate.zero, p.candidate.units_mb > 0, p.candidate.checkpointing != "none"))
    return Plan(shape, cluster, world, tuple(ranked), tuple(dict.fromkeys(rejected)))  # one row per distinct refusal


def _does_not_fit(p: Prediction, shape: ModelShape, cluster: Cluster) -> str:
    """The refusal of a layout over the device memory: which peak, and its parts."""
    m = p.memory
    reason = (f"does not fit: {m.total / _GB:.3g} GB > {cluster.memory_per_device / _GB:.3g} GB "
              f"(states {m.states / _GB:.3g}, activations {m.activations / _GB:.3g}, gathered {m.working / _GB:.3g}, "
              f"setup {m.setup / _GB:.3g})")
    if m.setup > m.training:
        built = ("the whole model, built with storage before the split: build it in configure_model() (on meta) to "
                 "hold only the rank's share" if not shape.built_on_meta
                 else "the rank's share plus one parameter at full size while it is materialised")
        reason += f"; the setup peak exceeds the step's ({built})"
    return reason


def strategy_overrides(c: Candidate) -> list[str]:
    """The ``strategy=...`` overrides that select the candidate's layout."""
    if c.engine == "deepspeed":
        return ["strategy=deepspeed", f"strategy.zero_stage={c.zero}"]
    if c.engine == "ddp":
        return ["strategy=ddp"]
    out = ["strategy=hybrid", f"strategy.data_parallel_size={c.dp}", f"strategy.pipeline_parallel_size={c.pp}",
           f"strategy.tensor_parallel_size={c.tp}", f"strategy.zero_stage={c.zero}"]
    if c.units_mb:
        out.append(f"strategy.bucket_size_mb={c.units_mb:g}")
    if c.cp > 1:
        out += [f"strategy.context_parallel_size={c.cp}", f"strategy.context_parallel_method={c.cp_method}"]
    if c.ep > 1:
        out.append(f"strategy.expert_parallel_size={c.ep}")
    if c.expert_shard:
        out.append("strategy.expert_data_shard=true")
    if c.pp > 1:
        out += [f"strategy.schedule={c.schedule}", f"strategy.stages_per_rank={c.stages_per_rank}",
                f"strategy.microbatches={c.microbatches}"]
    if c.checkpointing != "none":
        out.append(f"strategy.activation_checkpointing={c.checkpointing}")
    return out


def overrides(c: Candidate, work: Workload, devices: int, num_nodes: int = 1) -> list[str]:
    """Everything to paste after ``lp-train`` to run candidate ``c`` (strategy, devices, and the batch when it moved).

    Args:
        c: the layout.
        work: the configured batch (a batch size the planner changed is written out).
        devices: devices per node.
        num_nodes: nodes.
    """
    out = strategy_overrides(c) + [f"trainer.devices={devices}"]
    if num_nodes > 1:
        out.append(f"trainer.num_nodes={num_nodes}")
    if c.batch_size != work.batch_size:
        out.append(f"data.batch_size={c.batch_size}")
    return out
