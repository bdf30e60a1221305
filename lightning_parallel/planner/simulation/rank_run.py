"""One rank simulated: the suite's real path on a ``meta`` model in a fake world, and what the rank then holds.

The path is a real run's (:class:`~lightning_parallel.strategies.HybridParallelStrategy`'s ``setup``), step by step:
the model built on ``meta`` (its ``configure_model`` too), its adapter resolved once, ``check_module``, the run's
meshes (``RunMeshes.build``), ``parallelize`` -- with ``BuildSettings(simulated=True)``: nothing is materialised --
then ``configure_optimizers``, the optimizers switched to step on local shards as the strategy does, and one step on
``meta`` so each optimizer creates the state it really keeps.

Note:
    Where the data axis is torch's DDP (``zero_stage=0`` alone, :mod:`lightning_parallel.parallel.replicated`), DDP
    cannot wrap a ``meta`` model (its constructor reads values: ``Tensor.item()``): the rank is simulated without the
    wrapper, which changes no parameter (DDP holds the model as it is), and its gradients are counted as DDP keeps
    them (views of buckets that hold exactly the parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner.simulation import held
from lightning_parallel.planner.simulation.gathered import gathered_bytes
from lightning_parallel.planner.simulation.shards import ParamSpec, spec_of
from lightning_parallel.planner.simulation.step import run_step
from lightning_parallel.planner.simulation.world import fake_rank

ModelFactory = Callable[[], nn.Module]
DDP_NOTE = ("data axis is torch's DDP (zero_stage=0 alone): simulated without its wrapper, which cannot wrap a meta "
            "model; it changes no parameter, and its buckets hold the gradients (the parameters' bytes)")
PIPELINE_STEP_NOTE = ("pipelined: each stage ran one micro-batch outside the schedule (its shape inference needs real "
                      "peers); activations scaled by the micro-batches in flight under the schedule's action list; "
                      "send/recv from the schedule; collectives inside a stage not counted")
BALANCED_NOTE = ("MoE routing balanced (meta has no values): every expert receives the same token copies and every "
                 "rank routes alike; a real step's imbalance moves all-to-all bytes and expert activations between "
                 "the ranks of an expert group (their sum is the same)")
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


@dataclass
class RankRecord:
    """What one simulated rank holds after its first optimizer step.

    Attributes:
        rank: the rank simulated.
        stages: the pipeline stages it holds (empty without pipelining).
        specs: every parameter it holds, by its name in the unsplit model.
        local_shapes: the local shape of each of them, as torch built it.
        parameter_bytes, gradient_bytes, optimizer_bytes: bytes as stored (:mod:`.held`).
        padding_bytes: how much more the parameters' storage holds than their local shapes (FSDP2's padding).
        gathered_bytes: FSDP2's unsharded parameters held at once at the peak of a step (:mod:`.gathered`).
        notes: how the simulation differs from a real run, if at all.
        seconds: wall time of this rank's simulation.
    """

    rank: int
    stages: tuple[int, ...]
    specs: tuple[ParamSpec, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gathered_bytes: int
    padding_bytes: int = 0
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # further measurements (activations, collectives)


def build_on_meta(factory: ModelFactory, precision: str = "32-true") -> nn.Module:
    """``factory()`` built on ``meta``, its ``configure_model`` run there too, in the precision's dtype."""
    with torch.device("meta"):
        model = factory()
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    dtype = _TRUE_DTYPES.get(precision)
    return model.to(dtype) if dtype is not None else model


def aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name of the unsplit model -> the first name of its tied group (itself when untied)."""
    first: dict[int, str] = {}
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def simulate_rank(rank: int, layout: ParallelLayout, options: ParallelOptions, factory: ModelFactory,
                  precision: str = "32-true", batch: Optional[Callable[[], Any]] = None,
                  mailbox: Optional[dict] = None) -> RankRecord:
    """Play ``rank`` of ``layout`` in a fake world and measure what it holds after its first optimizer step.

    Args:
        rank: the rank to play.
        layout: the resolved layout.
        options: the run's options.
        factory: builds the model (called under ``torch.device("meta")``; its ``configure_model`` is run too).
        precision: the Trainer's precision name.
        batch: builds one batch of this rank on ``meta`` (as its data loader gives it); with it, one step runs and
            its collectives and saved activations are measured (:mod:`.step`, :mod:`.pipeline_step`); None: no step.
        mailbox: pipeline stage id -> its output on ``meta``, shared by the ranks of one simulation (a later
            pipeline position's input).

    Raises:
        ValueError: whatever a real run's set-up refuses (the same checks run), naming the fix.
    """
    from lightning_parallel.adapters import adapt
    from lightning_parallel.layout.meshes import RunMeshes
    from lightning_parallel.parallel.compose import BuildSettings, check_module, parallelize

    started = time.perf_counter()
    with fake_rank(rank, layout.world_size):
        model = build_on_meta(factory, precision)
        names, adapter = aliases(model), adapt(model)
        check_module(model, layout, options, adapter=adapter)
        meshes = RunMeshes.build(layout, "cpu", options.zero_stage)
        done = parallelize(model, meshes=meshes, options=options, adapter=adapter,
                           build=BuildSettings(precision, simulated=True))
        record = _measure(rank, model, names, layout, options, precision)
        if batch is not None:
            _step(record, model, done, meshes, batch, precision, {} if mailbox is None else mailbox)
        record.stages = tuple(done.stage_ids)
    record.seconds = time.perf_counter() - started
    return record


def _step(record: RankRecord, model: nn.Module, done: Any, meshes: Any, batch: Callable[[], Any],
          precision: str, mailbox: dict) -> None:
    """One step's collectives and saved activations into ``record.extra`` (:mod:`.step`), or a note saying why not."""
    from lightning_parallel.planner.simulation.pipeline_step import run_pipeline_step

    try:
        if done.pipelined:
            step = run_pipeline_step(done, batch(), mailbox, min(done.stage_ids))
            record.notes += (PIPELINE_STEP_NOTE,)
        else:
            step = run_step(model, done, meshes, batch(), precision)
    except (NotImplementedError, RuntimeError) as error:  # code that needs values: capacity drops, HF mask checks
        if "meta tensor" not in str(error).lower():
            raise
        record.notes += (f"step not simulated: {str(error).splitlines()[0][:120]} (the step reads "
                         "values, e.g. MoE capacity dropping, transformers' mask checks); activations and "
                         "collectives not measured",)
        return
    if step.details.get("balanced_routing_copies"):
        record.notes += (BALANCED_NOTE,)
    record.extra.update(activation_bytes=step.activation_bytes, collectives=step.collectives, **step.details)


def _measure(rank: int, model: nn.Module, names: dict[str, str], layout: ParallelLayout, options: ParallelOptions,
             precision: str) -> RankRecord:
    """Bytes of the parallelised ``model`` after one optimizer step (:mod:`.held`)."""
    from lightning_parallel.parallel.local_step import step_on_local_shards
    from lightning_parallel.parallel.precision import fsdp_policy
    from lightning_parallel.parallel.replicated import replicates_plain

    params = list(model.named_parameters())
    specs = [spec_of(names.get(name, name), param) for name, param in params]
    policy = fsdp_policy(precision, options, layout)
    reduce_dtype = getattr(policy, "reduce_dtype", None)
    reduce_itemsize = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype is not None else 0
    parameters = sum(held.parameter_bytes(p, s) for (_, p), s in zip(params, specs))
    gradients = sum(held.gradient_bytes(p, s, reduce_itemsize or p.element_size()) for (_, p), s in zip(params, specs))
    optimizers = held.optimizers_of(model.configure_optimizers())
    step_on_local_shards(optimizers)
    held.first_step(model, optimizers)
    notes = (DDP_NOTE,) if replicates_plain(layout, options, precision) else ()
    shapes = tuple(tuple(held.local(p).shape) for _, p in params)
    unpadded = sum(held.local(p).numel() * p.element_size() for _, p in params)
    return RankRecord(rank, (), tuple(specs), shapes, parameters, gradients, held.optimizer_bytes(optimizers),
                      gathered_bytes(model, options.zero_stage, policy), parameters - unpadded, notes)
