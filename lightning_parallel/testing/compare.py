"""Run one model under several parallel layouts and compare them step by step (``compare_layouts``).

Each layout runs in its own group of CPU processes (:func:`run_processes`), on the same global
data order and from the same initial weights, so that the layout is the only difference:

* the Trainer runs with ``use_distributed_sampler=False``: Lightning would otherwise wrap the
  training loader in a *shuffling* ``DistributedSampler`` under every multi-process strategy
  (even at a data-parallel size of 1), and a layout would train on other batches than one
  process. The data module must shard itself with ``strategy.distributed_sampler_kwargs``, as
  :func:`~lightning_parallel.resumable_loader.resumable_loader` does: with data-parallel size
  ``d`` and per-rank batch ``b`` the ranks of a step together serve the single process's batch
  of ``b*d``;
* every rank seeds with the same seed before it builds the module, so initialisation does
  not depend on the rank or the layout.

Per optimizer step each rank records the global-batch loss (:class:`LossHistory`), the true
global gradient norm across pipeline and tensor ranks (before clipping) and the learning rate;
at the end rank 0 gathers every parameter by its unsharded name (DTensors as full tensors,
pipeline stages from all ranks). :class:`~lightning_parallel.testing.results.LayoutComparison`
holds the verdict.
"""

from __future__ import annotations

import inspect
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch

from lightning_parallel.testing.parity import LossHistory
from lightning_parallel.testing.processes import run_processes
from lightning_parallel.testing.results import LayoutComparison, LayoutRun

# Trainer arguments a comparison sets unless the caller does: training only, nothing written.
QUIET = {"limit_val_batches": 0, "num_sanity_val_steps": 0}


@dataclass(frozen=True)
class Layout:
    """One layout to compare: a strategy and the number of processes it runs on.

    Args:
        strategy: a registered name (``"auto"``, ``"ddp"``, ``"pipeline_parallel"``), a strategy object, or a
            zero-argument factory such as ``functools.partial(HybridParallelStrategy, pipeline_parallel_size=2)``
            (must be picklable: it travels to the ranks). The data module is given the layout it resolves
            to (:func:`~lightning_parallel.strategies.resolve.resolve_layout`), however it is given.
        devices: processes of this layout.
        name: the label in tables (default: derived from the strategy and ``devices``).
        trainer_kwargs: Trainer arguments for this layout only.
    """

    strategy: Any
    devices: int
    name: Optional[str] = None
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        target = self.strategy
        if hasattr(target, "func"):  # functools.partial
            keywords = ",".join(f"{k}={v}" for k, v in target.keywords.items())
            return f"{target.func.__name__}({keywords}):{self.devices}"
        if not isinstance(target, str):
            target = getattr(target, "__name__", type(target).__name__)
        return f"{target}:{self.devices}"


def as_layout(spec: Any) -> Layout:
    """A :class:`Layout` from a Layout, ``(strategy, devices)`` or ``(strategy, devices, name)``."""
    if isinstance(spec, Layout):
        return spec
    if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        return Layout(*spec)
    raise TypeError(f"A layout is a Layout or (strategy, devices[, name]); got {spec!r}.")


@dataclass(frozen=True)
class Case:
    """One model set-up to compare across layouts.

    Args:
        module_factory: builds the LightningModule (picklable; called after seeding on every rank).
        datamodule_factory: builds the data module; called with the layout
            (:class:`~lightning_parallel.layout.ParallelLayout`) when it takes an argument, so it
            can size the per-rank batch as ``global_batch // layout.data_parallel``.
        trainer_kwargs: further Trainer arguments (``accumulate_grad_batches``, clipping, precision, ...).
    """

    module_factory: Callable[[], pl.LightningModule]
    datamodule_factory: Callable[..., pl.LightningDataModule]
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)


class StepRecorder(LossHistory):
    """:class:`LossHistory` plus, per optimizer step, the global gradient norm (before clipping) and the lr.

    Attributes:
        grad_norms: 2-norm of all gradients of the model, across pipeline and tensor ranks
            (``nan`` where the strategy keeps gradients out of ``param.grad``, e.g. DeepSpeed).
        lrs: learning rate of the first parameter group, as used by the step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.grad_norms: list[float] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from lightning_parallel.parallel.grad_norm_clipping import total_grad_norm

        params = [p for group in optimizer.param_groups for p in group["params"]]
        has_grads = any(p.grad is not None for p in params)
        norm = total_grad_norm(params, 2.0, pipeline_group(trainer.strategy))
        self.grad_norms.append(float(norm) if has_grads else math.nan)
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def pipeline_group(strategy: Any) -> Any:
    """The strategy's pipeline process group, or None when the model is not pipelined."""
    from lightning_parallel.layout import PIPELINE_PARALLEL

    layout = getattr(strategy, "layout", None)
    if layout is None or not layout.pipeline_parallel_enabled:
        return None
    return strategy.device_mesh[PIPELINE_PARALLEL].get_group()


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model by its unsharded name, on rank 0 (``{}`` elsewhere).

    DTensors become full tensors (a collective over their mesh: every rank calls this); pipeline
    stages hold disjoint names, gathered to rank 0 with ``gather_object``. Values are float64 on CPU.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = {}
    # remove_duplicate=False: one process lists a tied pair once (under its first name) while
    # pipeline stages each hold one of the two names; listing both on every side compares both.
    for name, param in module.named_parameters(remove_duplicate=False):
        value = param.detach()
        value = value.full_tensor() if isinstance(value, DTensor) else value
        local[name] = value.to("cpu", torch.float64).clone()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or []:
        merged.update(part)
    return merged


def _fit_one(layout: Layout, case: Case, world_size: int, steps: int, seed: int, accelerator: str,
             trace_step: Optional[int] = None) -> dict[str, Any]:
    """Fit ``case`` under ``layout`` in this rank; the recorded steps and (rank 0) the final parameters,
    or with ``trace_step`` this rank's :class:`~lightning_parallel.testing.trace.TraceRecorder` record of that step."""
    from lightning_parallel.strategies.resolve import resolve_layout
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.trace import TraceRecorder

    pl.seed_everything(seed, verbose=False)
    module = case.module_factory()
    strategy = layout.strategy
    if callable(strategy) and not isinstance(strategy, (str, pl.strategies.Strategy)):
        strategy = strategy()
    data = case.datamodule_factory
    takes_layout = bool(inspect.signature(data).parameters) if callable(data) else False
    datamodule = data(resolve_layout(strategy, world_size)) if takes_layout else data()
    recorder = StepRecorder() if trace_step is None else TraceRecorder(trace_step)
    kwargs = {**QUIET, **case.trainer_kwargs, **layout.trainer_kwargs}
    trainer = quiet_trainer(world_size, strategy, steps, [recorder], accelerator=accelerator, **kwargs)
    trainer.fit(module, datamodule=datamodule)
    if trace_step is not None:
        return recorder.record(trainer.strategy, trainer.global_rank)
    params = full_parameters(trainer.lightning_module)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "lrs": recorder.lrs,
            "parameters": params if trainer.global_rank == 0 else None}


def _fit_cases(rank: int, world_size: int, layout: Layout, cases: dict[str, Case], steps: int, seed: int,
               accelerator: str, trace_step: Optional[int] = None) -> dict[str, dict[str, Any]]:
    """Rank function: every case under one layout, one after another in the same processes."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*(validation_step|treespec|set_vital).*")
    return {name: _fit_one(layout, case, world_size, steps, seed, accelerator, trace_step)
            for name, case in cases.items()}


def trace_divergence(case: Case, reference: Layout, layout: Layout, result: LayoutComparison, *, seed: int = 0,
                     accelerator: str = "cpu", timeout: float = 900.0) -> Any:
    """Replay ``result``'s first divergent step on the reference and ``layout``; the first differing module.

    Returns:
        A :class:`~lightning_parallel.testing.trace.Divergence` (also added to ``result.notes``).
    """
    from lightning_parallel.testing.trace import first_divergence

    step = result.first_divergence[0]
    records = [run_processes(_fit_cases, spec.devices, spec, {"case": case}, step + 1, seed, accelerator, step,
                             timeout=timeout) for spec in (reference, layout)]
    ref, run = ([ranks["case"] for ranks in per_rank] for per_rank in records)
    divergence = first_divergence(step, layout.label, ref, run, result.tolerance)
    result.trace = divergence
    result.notes.append(divergence.describe())
    return divergence


def _runs(layout: Layout, per_rank: list[dict[str, dict[str, Any]]], case: str) -> LayoutRun:
    results = [ranks[case] for ranks in per_rank]
    return LayoutRun(
        name=layout.label,
        devices=layout.devices,
        losses=[r["losses"] for r in results],
        grad_norms=results[0]["grad_norms"],
        lrs=results[0]["lrs"],
        parameters=results[0]["parameters"],
    )


# A layout may differ from the reference by this multiple of the reference's own low-precision error.
AUTO_TOLERANCE_FACTOR = 2.0


def _derived_tolerances(cases: Mapping[str, Case], reference: Layout, steps: int, seed: int, accelerator: str,
                        timeout: float) -> dict[str, tuple[float, str]]:
    """``tolerance="auto"``: per case, ``AUTO_TOLERANCE_FACTOR x`` the largest difference of the reference
    layout at the case's precision from the same layout in fp32 (losses, relative grad norms, parameters)."""
    fp32 = Layout(reference.strategy, reference.devices, f"{reference.label}/fp32",
                  {**reference.trainer_kwargs, "precision": "32-true"})
    launches = [run_processes(_fit_cases, spec.devices, spec, dict(cases), steps, seed, accelerator, timeout=timeout)
                for spec in (fp32, reference)]
    derived = {}
    for name, case in cases.items():
        precision = case.trainer_kwargs.get("precision", reference.trainer_kwargs.get("precision", "32-true"))
        own = LayoutComparison.build(
            [_runs(spec, per_rank, name) for spec, per_rank in zip((fp32, reference), launches)], math.inf
        ).diffs[0]
        error = max(own.loss, own.grad_norm_relative, own.parameter[1])
        tolerance = AUTO_TOLERANCE_FACTOR * error if error > 0 else 1e-5
        derived[name] = (tolerance, f"lp-compare: tolerance {tolerance:.3e} = {AUTO_TOLERANCE_FACTOR:g} x the largest "
                                    f"difference of {reference.label} at precision {precision} from fp32 ({error:.3e})")
    return derived


def compare_cases(
    cases: Mapping[str, Case],
    layouts: Sequence[Any],
    steps: int,
    tolerance: Union[float, str] = 1e-5,
    *,
    seed: int = 0,
    accelerator: str = "cpu",
    timeout: float = 900.0,
    trace: bool = False,
) -> dict[str, LayoutComparison]:
    """:func:`compare_layouts` for several model set-ups at once: one launch per layout runs every case.

    Args:
        cases: name -> :class:`Case`.
        layouts: see :func:`compare_layouts`; the first is the reference.
        steps: see :func:`compare_layouts`.
        tolerance: see :func:`compare_layouts`.
        seed: see :func:`compare_layouts`.
        accelerator: see :func:`compare_layouts`.
        timeout: see :func:`compare_layouts`.
        trace: see :func:`compare_layouts`.

    Returns:
        name -> :class:`LayoutComparison` of that case.
    """
    specs = [as_layout(spec) for spec in layouts]
    if len(specs) < 2:
        raise ValueError(f"Compare at least two layouts (the first is the reference); got {len(specs)}.")
    launches = [
        run_processes(_fit_cases, spec.devices, spec, dict(cases), steps, seed, accelerator, timeout=timeout)
        for spec in specs
    ]
    derived = _derived_tolerances(cases, specs[0], steps, seed, accelerator, timeout) if tolerance == "auto" else {}
    results = {}
    for name in cases:
        runs = [_runs(spec, per_rank, name) for spec, per_rank in zip(specs, launches)]
        results[name] = LayoutComparison.build(runs, derived[name][0] if derived else float(tolerance))
        results[name].notes.extend([derived[name][1]] if derived else [])
    for name, result in results.items():
        if trace and result.first_divergence is not None:
            diverging = next(spec for spec in specs if spec.label == result.first_divergence[1])
            trace_divergence(
                cases[name], specs[0], diverging, result, seed=seed, accelerator=accelerator, timeout=timeout
            )
    return results


def compare_layouts(
    module_factory: Callable[[], pl.LightningModule],
    datamodule_factory: Callable[..., pl.LightningDataModule],
    layouts: Sequence[Any],
    steps: int,
    tolerance: Union[float, str] = 1e-5,
    *,
    trainer_kwargs: Optional[Mapping[str, Any]] = None,
    seed: int = 0,
    accelerator: str = "cpu",
    timeout: float = 900.0,
    trace: bool = False,
) -> LayoutComparison:
    """Fit the same model for ``steps`` optimizer steps under every layout and compare them with the first.

    Args:
        module_factory: builds the LightningModule (picklable: a module-level function or a partial).
        datamodule_factory: builds the data module; given the layout if it takes an argument (see :class:`Case`).
            It must serve a fixed order and shard with ``strategy.distributed_sampler_kwargs``
            (e.g. :class:`~lightning_parallel.testing.models.FixedOrderData` or ``resumable_loader``).
        layouts: :class:`Layout` objects or ``(strategy, devices)`` pairs; the first is the reference
            (usually ``("auto", 1)``: one process).
        steps: optimizer steps.
        tolerance: largest allowed difference: absolute for losses, learning rates and parameters,
            relative to ``max(1, |reference|)`` for gradient norms. ``"auto"`` (for ``precision="bf16-mixed"``
            & co.): twice the reference layout's own difference from fp32 on the same run (an extra launch;
            the derivation is in ``result.notes``).
        trainer_kwargs: Trainer arguments for every layout (``gradient_clip_val``, ``precision``, ...).
        seed: seeded on every rank before the module is built.
        accelerator: ``"cpu"`` (gloo ranks) or ``"cuda"``.
        timeout: seconds per layout before its ranks are killed.
        trace: on a mismatch, replay the first divergent step and name the first differing module
            (:func:`trace_divergence`; ``result.trace``).

    Returns:
        A :class:`LayoutComparison`: true when every layout agrees with the reference.
    """
    case = Case(module_factory, datamodule_factory, dict(trainer_kwargs or {}))
    return compare_cases({"case": case}, layouts, steps, tolerance, seed=seed, accelerator=accelerator,
                         timeout=timeout, trace=trace)["case"]
