"""Every layout of a world: data x context x pipeline x tensor sizes, context method, ZeRO stage, schedule,
micro-batches, checkpointing.

:func:`enumerate_layouts` returns the candidates that can run and, for every other one, a
:class:`Rejected` with the reason, in the words of the check that would refuse it at start-up
(the suite's own checks are called where they exist: schedule rules, micro-batch splits,
scaling of the batch, the sequence's split into ``2 x cp`` chunks, Ulysses' head split).

A context size is tried for every divisor of the world, only for a model with attention
(``shape.attention``) whose sequence cuts into ``2 x cp`` chunks; each context size > 1 with every
method of the search space (ring, and Ulysses where the heads split). Context ranks share their data
replica's samples, so the scaling rule sees the data size alone.

An expert size is tried, for a model with experts (``shape.experts``), for every divisor of data x context
(the ranks it borrows) that divides the expert count, under the hybrid strategy only. A split of the batch
the model refuses (``shape.split_refusals``: a balancing loss a pipeline schedule cannot form) is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from lightning_parallel.layout import factorizations
from lightning_parallel.parallel.checks import SPLIT_BACKWARD_SCHEDULES
from lightning_parallel.parallel.pipeline.schedules import SCHEDULES, check_microbatches, validate_schedule
from lightning_parallel.planner import experts as expert_axis
from lightning_parallel.planner.context import method_reason, size_reason
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.scaling import Reference, rescale

CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class Workload:
    """The batch a run trains with, as the config gives it (the scaling rule decides it per layout).

    Args:
        rule: the scaling rule (``none``, ``linear``, ``sqrt``, ``fixed_global_batch``).
        reference: the scaling reference.
        batch_size: samples per data-parallel rank per forward/backward (``data.batch_size``).
        accumulate: configured gradient accumulation.
        lr: configured learning rate.
        warmup_steps: configured warm-up.
    """

    rule: str
    reference: Reference
    batch_size: int
    accumulate: int = 1
    lr: float = 1e-3
    warmup_steps: int = 0


@dataclass(frozen=True)
class SearchSpace:
    """Which settings the planner tries besides the sizes.

    Args:
        zero_stages: ZeRO stages of the hybrid strategy (FSDP2 over the data axis).
        deepspeed_stages: DeepSpeed ZeRO stages (data parallel only); empty to leave DeepSpeed out.
        ddp: Lightning's own ``DDPStrategy`` (data parallel only, ``strategy=ddp``); False to leave it out.
        schedules: pipeline schedules.
        microbatch_factors: micro-batches per batch as multiples of the stage count.
        batch_sizes: per-rank batch sizes to try under ``fixed_global_batch`` (None: the configured one and every
            power of two dividing the per-rank share of the global batch).
        checkpointing: activation checkpointing modes (only those the strategies offer).
        max_accumulation: under ``fixed_global_batch``, the most batches per optimizer step (None: any).
        context_sizes: context-parallel sizes to try (None: every divisor of the world; ``(1,)``: none).
        context_methods: context-parallel methods (``ring``, ``ulysses``).
        expert_sizes: expert-parallel sizes to try (None: every divisor of data x context; ``(1,)``: none).
        zero2_units_mb: FSDP2 unit sizes tried for the hybrid strategy's ZeRO 2 besides one unit per layer
            (``strategy.bucket_size_mb``: fewer collectives, no parameter memory); empty: per layer only.
    """

    zero_stages: tuple[int, ...] = (0, 2, 3)
    deepspeed_stages: tuple[int, ...] = (1, 2, 3)
    ddp: bool = True
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b", "zbv")
    microbatch_factors: tuple[int, ...] = (1, 2, 4)
    batch_sizes: Optional[tuple[int, ...]] = None
    checkpointing: tuple[str, ...] = ("none",)
    max_accumulation: Optional[int] = None
    context_sizes: Optional[tuple[int, ...]] = None
    context_methods: tuple[str, ...] = ("ring", "ulysses")
    expert_sizes: Optional[tuple[int, ...]] = None
    zero2_units_mb: tuple[float, ...] = (25.0,)


@dataclass(frozen=True)
class Candidate:
    """One layout the strategies can run.

    Args:
        engine: ``hybrid`` (the suite's data x pipeline x tensor strategy), ``deepspeed`` or ``ddp`` (Lightning's).
        dp: data-parallel size. pp: pipeline size. tp: tensor-parallel size.
        zero: ZeRO stage (hybrid: 0, 2, 3; deepspeed: 1, 2, 3).
        schedule: pipeline schedule (``-`` without pipeline).
        stages_per_rank: pipeline stages per rank.
        microbatches: micro-batches per batch (1 without pipeline).
        batch_size: samples per data-parallel rank per forward/backward.
        accumulate: batches per optimizer step.
        global_batch: samples per optimizer step.
        checkpointing: activation checkpointing mode.
        cp: context-parallel size (ranks splitting each sequence of a data replica).
        cp_method: ``ring`` or ``ulysses`` (``-`` without context parallelism).
        ep: expert-parallel size (ranks of data x context sharing each MoE module's experts; 1: off).
        units_mb: hybrid ZeRO 2: layers grouped into FSDP2 units of up to this many MB (0: one per layer).
        expert_shard: the experts also sharded over their expert-data ranks (``expert_data_shard``).
    """

    engine: str
    dp: int
    pp: int
    tp: int
    zero: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    batch_size: int
    accumulate: int
    global_batch: int
    checkpointing: str = "none"
    cp: int = 1
    cp_method: str = "-"
    ep: int = 1
    units_mb: float = 0.0
    expert_shard: bool = False

    @property
    def world(self) -> int:
        """Processes the layout runs on."""
        return self.dp * self.cp * self.pp * self.tp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters (data x context): gradients reduce, and FSDP2 shards, over them."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        """Short label: ``dp2xpp2 zero2 1f1b m4``, ``dp2xcp2 ring b4``, ``dp4 ep4 b2``."""
        axes = (("dp", self.dp), ("cp", self.cp), ("pp", self.pp), ("tp", self.tp))
        sizes = "x".join(f"{a}{n}" for a, n in axes if n > 1) or "dp1"
        engine = {"deepspeed": f"ds{self.zero}", "ddp": "ddp"}.get(self.engine, f"zero{self.zero}" if self.zero else "")
        units = f"u{self.units_mb:g}" if self.units_mb else ""
        experts = (f"ep{self.ep}" + ("-shard" if self.expert_shard else "")) if self.ep > 1 else ""
        parts = [sizes, self.cp_method if self.cp > 1 else "", experts, engine, units]
        if self.pp > 1:
            parts += [self.schedule + (f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""),
                      f"m{self.microbatches}"]
        parts += [f"b{self.batch_size}"] + ([f"ac:{self.checkpointing}"] if self.checkpointing != "none" else [])
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Rejected:
    """A layout that cannot run, and why (``reason`` names the failed check)."""

    label: str
    reason: str
    kind: str = field(default="invalid")


def _tp_reasons(shape: ModelShape, tp: int) -> Optional[str]:
    bad = [f"{what}={size}" for what, size in shape.tp_divides if size % tp]
    return f"heads/widths not divisible: tensor size {tp} does not divide {', '.join(bad)}" if bad else None


def _batch_sizes(space: SearchSpace, work: Workload, dp: int) -> list[int]:
    if work.rule != "fixed_global_batch":
        return [work.batch_size]
    if space.batch_sizes is not None:
        return list(space.batch_sizes)
    share = (work.reference.global_batch_size or 0) // dp
    powers = [b for b in (2**i for i in range(12)) if share and share % b == 0]
    sizes = sorted({work.batch_size, *powers})
    limit = space.max_accumulation
    return [b for b in sizes if limit is None or not share or share % b or share // b <= limit]


def _pipeline_settings(space: SearchSpace, pp: int, batch: int) -> tuple[list[tuple[str, int, int]], list[str]]:
    """(schedule, stages per rank, micro-batches) that torch runs for ``pp`` ranks on ``batch``; and refusals."""
    if pp == 1:
        return [("-", 1, 1)], []
    settings, reasons = [], []
    for schedule in space.schedules:
        v = {"one": 1, "two": 2, "many": 2}[SCHEDULES[schedule][1]]
        for factor in space.microbatch_factors:
            m = factor * pp
            try:
                validate_schedule(schedule, pp, v, m)
            except ValueError as error:
                reasons.append(f"{schedule} m{m}|schedule refuses: {error}")
                continue
            try:
                check_microbatches(batch, m)
            except ValueError as error:
                reasons.append(f"{schedule} m{m}|micro-batches do not split the batch: {error}")
                continue
            settings.append((schedule, v, m))
    return sorted(set(settings)), reasons


def _engines(space: SearchSpace, dp: int, cp: int, pp: int, tp: int, ep: int = 1) -> list[tuple[str, int, float]]:
    """(engine, ZeRO stage, unit MB) triples: the hybrid strategy's stages where data x context has replicas to shard
    over (ZeRO 2 also in units of layers), DeepSpeed's and Lightning's DDP on data parallelism alone (without experts
    sharded)."""
    engines = [("hybrid", z, 0.0) for z in space.zero_stages if z == 0 or dp * cp > 1]
    if ("hybrid", 2, 0.0) in engines:
        engines += [("hybrid", 2, float(mb)) for mb in space.zero2_units_mb if mb]
    if pp == tp == cp == ep == 1 and dp > 1:
        engines += [("deepspeed", s, 0.0) for s in space.deepspeed_stages] + ([("ddp", 0, 0.0)] if space.ddp else [])
    return engines


def _context_options(shape: ModelShape, world: int, space: SearchSpace) -> tuple[list[int], list[Rejected]]:
    """The context sizes to enumerate, and a refusal for each divisor of the world that cannot split the model."""
    wanted = [n for n in range(1, world + 1) if world % n == 0]
    if space.context_sizes is not None:
        wanted = [n for n in wanted if n in space.context_sizes]
    sizes, rejected = [], []
    for cp in wanted:
        reason = size_reason(shape, cp) if cp > 1 else None
        if reason is None:
            sizes.append(cp)
        elif shape.attention is None:  # one row says it for every size
            rejected.append(Rejected("context_parallel_size>1", reason))
            break
        else:
            rejected.append(Rejected(f"cp{cp}", reason))
    return sizes, rejected


def _context_methods(shape: ModelShape, space: SearchSpace, cp: int, tp: int,
                     label: str) -> tuple[list[str], list[Rejected]]:
    """The methods that run ``cp`` context ranks under ``tp`` tensor ranks (``-`` without context), and refusals."""
    if cp == 1:
        return ["-"], []
    methods, rejected = [], []
    for method in space.context_methods:
        reason = method_reason(shape.attention, method, cp, tp)
        if reason is None:
            methods.append(method)
        else:
            rejected.append(Rejected(f"{label} {method}", reason))
    return methods, rejected


def _expert_options(shape: ModelShape, space: SearchSpace, replicas: int,
                    label: str) -> tuple[list[int], list[Rejected]]:
    """The expert sizes of ``replicas`` data x context ranks to enumerate (1 alone without experts), and refusals."""
    if shape.experts is None:
        return [1], []
    wanted = [n for n in range(1, replicas + 1) if replicas % n == 0]
    if space.expert_sizes is not None:
        wanted = [n for n in wanted if n in space.expert_sizes]
    sizes, rejected = [], []
    for ep in wanted:
        reason = expert_axis.size_reason(shape, ep) if ep > 1 else None
        if reason is None:
            sizes.append(ep)
        else:
            rejected.append(Rejected(f"{label} ep{ep}", reason))
    return sizes, rejected


def _split_reason(shape: ModelShape, dp: int, cp: int, pp: int) -> Optional[str]:
    """Why the model refuses how ``dp``, ``cp``, ``pp`` split its batch (None: it does not)."""
    used = {"data": dp > 1, "context": cp > 1, "pipeline": pp > 1}
    for axis, reason in shape.split_refusals:
        if used.get(axis):
            return f"the model refuses the {axis} split: {reason}"
    return None


def enumerate_layouts(shape: ModelShape, world: int, work: Workload,
                      space: SearchSpace = SearchSpace()) -> tuple[list[Candidate], list[Rejected]]:
    """Every candidate layout of ``world`` ranks for ``shape``, and every refused one with its reason.

    Args:
        shape: the model.
        world: processes in the run.
        work: the configured batch and scaling rule.
        space: the settings to try besides the sizes.
    """
    candidates, rejected = [], []
    checkpointing = space.checkpointing
    if "selective" in checkpointing and any(layer.selective_saved is None for layer in shape.layers):
        checkpointing = tuple(ac for ac in checkpointing if ac != "selective")
        rejected.append(Rejected("activation_checkpointing=selective", "not modelled: what selective checkpointing "
                                 f"keeps of {shape.name}'s measured layers is not known; none and full are planned"))
    sizes, rejected_sizes = _context_options(shape, world, space)
    rejected += rejected_sizes
    for cp in sizes:
        for dp, pp, tp in factorizations(world // cp):
            found, refused = _layouts(shape, work, space, checkpointing, dp, cp, pp, tp)
            candidates += found
            rejected += refused
    return candidates, rejected


def _layouts(shape: ModelShape, work: Workload, space: SearchSpace, checkpointing: tuple[str, ...], dp: int, cp: int,
             pp: int, tp: int) -> tuple[list[Candidate], list[Rejected]]:
    """The candidates of one size quadruple, and the refusals met on the way."""
    candidates, rejected = [], []
    layers = len(shape.layers)
    label = f"dp{dp}xcp{cp}xpp{pp}xtp{tp}" if cp > 1 else f"dp{dp}xpp{pp}xtp{tp}"
    reason = _tp_reasons(shape, tp) if tp > 1 else None
    if reason is None and pp > layers:
        reason = f"too few layers: {layers} pipeline layers cannot fill {pp} stages"
    reason = reason or _split_reason(shape, dp, cp, pp)
    if reason:
        return [], [Rejected(label, reason)]
    methods, rejected = _context_methods(shape, space, cp, tp, label)
    expert_sizes, refused = _expert_options(shape, space, dp * cp, label)
    rejected += refused
    for batch in _batch_sizes(space, work, dp):
        try:
            eff = rescale(work.rule, work.reference, dp, batch, work.accumulate, work.lr, work.warmup_steps)
        except ValueError as error:
            rejected.append(Rejected(f"{label} b{batch}", f"batch does not divide: {error}"))
            continue
        settings, reasons = _pipeline_settings(space, pp, batch)
        rejected += [Rejected(f"{label} b{batch} {r.split('|')[0]}", r.split("|", 1)[1]) for r in reasons]
        for (schedule, v, m) in settings:
            if pp * v > layers:
                rejected.append(Rejected(f"{label} {schedule}", f"too few layers: {layers} for {pp * v} stages"))
                continue
            for ep in expert_sizes:
                for engine, zero, units in _engines(space, dp, cp, pp, tp, ep):
                    if zero == 3 and engine == "hybrid" and pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
                        continue  # refused before start (parallel/checks.py): the weight pass after FSDP2's reshard
                    base = Candidate(engine, dp, pp, tp, zero, schedule, v, m, eff.micro_batch_size,
                                     eff.accumulate_grad_batches, eff.global_batch_size, cp=cp, ep=ep, units_mb=units)
                    modes = checkpointing if engine != "ddp" else ("none",)  # strategy=ddp has no checkpointing
                    shards = (False, True) if ep > 1 and dp * cp // ep > 1 else (False,)  # expert_data_shard
                    candidates += [replace(base, checkpointing=ac, cp_method=method, expert_shard=shard)
                                   for method in methods for ac in modes for shard in shards]
    return candidates, rejected
