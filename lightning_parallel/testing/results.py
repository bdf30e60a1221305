"""The result of a layout comparison: per-step differences from the reference layout, the worst
parameter, a verdict (``bool(result)``) and the tables that show them."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from rich.console import Console
from rich.table import Table


@dataclass
class LayoutRun:
    """What one layout recorded: losses of every rank, and (from rank 0) grad norms, lrs, parameters."""

    name: str
    devices: int
    losses: list[list[float]]
    grad_norms: list[float]
    lrs: list[float]
    parameters: Optional[dict[str, torch.Tensor]] = None

    def step_losses(self) -> list[float]:
        """Rank 0's loss per optimizer step (the mean of its accumulated batches)."""
        batches, steps = self.losses[0], max(1, len(self.grad_norms))
        per = max(1, len(batches) // steps)
        return [sum(batches[i : i + per]) / per for i in range(0, per * steps, per) if batches[i : i + per]]


@dataclass
class LayoutDiff:
    """How far one layout is from the reference (largest differences over steps and ranks).

    Attributes:
        loss: largest |loss - reference loss| over every batch and every rank.
        rank_spread: largest difference between two ranks of this layout (0.0: all report the same loss).
        grad_norm: largest |grad norm - reference| (relative to ``max(1, |reference|)`` in the verdict).
        lr: largest |lr - reference lr|.
        parameter: ``(name, largest |difference|)`` of the worst parameter at the end.
        missing: parameter names one side has and the other lacks.
    """

    name: str
    devices: int
    loss: float
    rank_spread: float
    grad_norm: float
    grad_norm_relative: float
    lr: float
    parameter: tuple[str, float]
    missing: list[str] = field(default_factory=list)

    def agrees(self, tolerance: float) -> bool:
        grad = () if math.isnan(self.grad_norm_relative) else (self.grad_norm_relative,)  # NaN: not recorded
        values = (self.loss, *grad, self.lr, self.parameter[1])
        return not self.missing and all(v <= tolerance for v in values)


def _max_abs(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return math.inf
    if not a:
        return 0.0
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    both_nan = torch.isnan(diff) & torch.isnan(torch.tensor(b, dtype=torch.float64))
    return float(diff.abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf).max())


def _parameter_diff(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[tuple[str, float], list[str]]:
    missing = sorted(set(run) ^ set(ref))
    worst = ("-", 0.0)
    for name in sorted(set(run) & set(ref)):
        if run[name].shape != ref[name].shape:
            missing.append(f"{name} (shape {tuple(run[name].shape)} vs {tuple(ref[name].shape)})")
            continue
        diff = float((run[name] - ref[name]).abs().max()) if run[name].numel() else 0.0
        if diff > worst[1] or worst[0] == "-":
            worst = (name, diff)
    return worst, missing


def diff_from(run: LayoutRun, ref: LayoutRun) -> LayoutDiff:
    """The differences of ``run`` from the reference ``ref``."""
    loss = max(_max_abs(losses, ref.losses[0]) for losses in run.losses)
    spread = max(_max_abs(losses, run.losses[0]) for losses in run.losses)
    # A run that records no gradient norm (DeepSpeed keeps it inside its engine: all NaN) is
    # judged on its losses and parameters, not reported as infinitely far off.
    recorded = any(math.isfinite(g) for g in run.grad_norms)
    grad = _max_abs(run.grad_norms, ref.grad_norms) if recorded or not run.grad_norms else math.nan
    scale = max([1.0] + [abs(g) for g in ref.grad_norms if math.isfinite(g)])
    parameter, missing = _parameter_diff(run.parameters or {}, ref.parameters or {})
    return LayoutDiff(
        run.name, run.devices, loss, spread, grad, grad / scale, _max_abs(run.lrs, ref.lrs), parameter, missing
    )


def _fmt(value: float, tolerance: Optional[float] = None) -> str:
    if math.isnan(value):
        return "-"
    text = f"{value:.3e}" if tolerance is not None else f"{value:.6f}"
    return f"[red]{text}[/red]" if tolerance is not None and value > tolerance else text


@dataclass
class LayoutComparison:
    """Every layout against the first (the reference); ``bool(result)``: all agree within ``tolerance``.

    Attributes:
        runs: what each layout recorded (the reference first; parameters dropped after comparing).
        diffs: one :class:`LayoutDiff` per non-reference layout.
        tolerance: the largest allowed difference.
        first_divergence: ``(step, layout, quantity, |difference|)`` of the first step where a
            layout's loss or gradient norm leaves the tolerance, or None.
        notes: extra lines shown under the tables (e.g. the first-divergence trace).
        trace: the :class:`~lightning_parallel.testing.trace.Divergence` when traced, else None.
    """

    runs: list[LayoutRun]
    diffs: list[LayoutDiff]
    tolerance: float
    first_divergence: Optional[tuple[int, str, str, float]] = None
    notes: list[str] = field(default_factory=list)
    trace: Optional[Any] = None

    @classmethod
    def build(cls, runs: list[LayoutRun], tolerance: float) -> "LayoutComparison":
        """Compare ``runs[1:]`` with ``runs[0]``."""
        ref = runs[0]
        diffs = [diff_from(run, ref) for run in runs[1:]]
        result = cls(runs, diffs, tolerance, _first_divergence(runs, tolerance))
        for run in runs:
            run.parameters = None
        return result

    def __bool__(self) -> bool:
        return all(d.agrees(self.tolerance) for d in self.diffs)

    @property
    def worst_parameter(self) -> tuple[str, str, float]:
        """``(layout, parameter name, |difference|)`` of the largest final parameter difference."""
        worst = max(self.diffs, key=lambda d: d.parameter[1])
        return worst.name, worst.parameter[0], worst.parameter[1]

    def step_table(self) -> Table:
        """Per optimizer step: the reference's loss, grad norm and lr, and each layout's |difference|."""
        ref, others, tol = self.runs[0], self.runs[1:], self.tolerance
        table = Table(title=f"lp-compare: per step (reference {ref.name}, tolerance {tol:g})", title_justify="left")
        for header in ["step", f"loss {ref.name}", *[f"Δloss {o.name}" for o in others], f"grad norm {ref.name}",
                       *[f"Δgnorm {o.name}" for o in others], "lr", "max Δlr"]:
            table.add_column(header, justify="right")
        losses = [run.step_losses() for run in self.runs]
        for step in range(len(ref.grad_norms)):
            row = [str(step), _fmt(_at(losses[0], step))]
            row += [_fmt(abs(_at(lo, step) - _at(losses[0], step)), tol) for lo in losses[1:]]
            row.append(_fmt(ref.grad_norms[step]))
            row += [_fmt(abs(_at(o.grad_norms, step) - ref.grad_norms[step]), tol * max(1.0, abs(ref.grad_norms[step])))
                    for o in others]
            lr_diff = max(abs(_at(o.lrs, step) - ref.lrs[step]) for o in others) if others else 0.0
            table.add_row(*row, f"{ref.lrs[step]:.3e}", _fmt(lr_diff, tol))
        return table

    def summary_table(self) -> Table:
        """One row per layout: largest differences, the worst parameter and the verdict."""
        table = Table(title="lp-compare: layouts against the reference", title_justify="left")
        for header in ["layout", "devices", "max |Δloss|", "rank spread", "max |Δgnorm|", "max |Δlr|",
                       "worst parameter", "|Δparam|", "verdict"]:
            table.add_column(header, justify="left" if header in ("layout", "worst parameter") else "right")
        tol = self.tolerance
        for d in self.diffs:
            verdict = "[green]match[/green]" if d.agrees(tol) else "[red]DIFFERS[/red]"
            name = d.parameter[0] + (f" (+{len(d.missing)} missing)" if d.missing else "")
            table.add_row(d.name, str(d.devices), _fmt(d.loss, tol), _fmt(d.rank_spread, tol), _fmt(d.grad_norm, tol),
                          _fmt(d.lr, tol), name, _fmt(d.parameter[1], tol), verdict)
        return table

    def print(self, console: Optional[Console] = None) -> None:
        """Print both tables and the verdict."""
        console = console or Console(width=200)
        console.print(self.step_table())
        console.print(self.summary_table())
        for note in self.notes:
            console.print(note)
        console.print(self.verdict())

    def verdict(self) -> str:
        """One line: all layouts match, or where they first part."""
        if self:
            return f"lp-compare: all {len(self.diffs) + 1} layouts agree within {self.tolerance:g}"
        if self.first_divergence is not None:
            step, layout, what, value = self.first_divergence
            return f"lp-compare: {layout} first differs at step {step}: |Δ{what}| = {value:.3e} > {self.tolerance:g}"
        worst = [d for d in self.diffs if not d.agrees(self.tolerance)][0]
        return (f"lp-compare: {worst.name} differs: parameter {worst.parameter[0]} |Δ| = {worst.parameter[1]:.3e}"
                + (f", missing {worst.missing}" if worst.missing else ""))

    def render(self) -> str:
        """The tables and verdict as plain text (for assertion messages and logs)."""
        console = Console(width=200, record=True, file=io.StringIO())
        self.print(console)
        return console.export_text()

    def __str__(self) -> str:
        return self.render()


def _at(values: list[float], index: int) -> float:
    return values[index] if index < len(values) else math.nan


def _first_divergence(runs: list[LayoutRun], tolerance: float) -> Optional[tuple[int, str, str, float]]:
    ref = runs[0]
    ref_losses = ref.step_losses()
    for step in range(len(ref.grad_norms)):
        for run in runs[1:]:
            loss = abs(_at(run.step_losses(), step) - ref_losses[step])
            if not loss <= tolerance:
                return step, run.name, "loss", loss
            if not any(math.isfinite(g) for g in run.grad_norms):
                continue  # the run records no gradient norm (DeepSpeed): its losses decided above
            grad = abs(_at(run.grad_norms, step) - ref.grad_norms[step])
            if not grad <= tolerance * max(1.0, abs(ref.grad_norms[step])) and not math.isnan(ref.grad_norms[step]):
                return step, run.name, "grad norm", grad
    return None
