"""The matrix from end to end: classify the families, refuse before start, run each layout, judge, write."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.hf_coverage import adamw, cells, pretrained, table, tiny
from benchmarks.hf_coverage.optimizers import optimizer

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "hf-coverage.md"
#: The families CI runs by default (tests/distributed/adapters/test_hf_coverage.py): one of each kind the
#: adapters handle -- a plain decoder, fused projections, embedding/logit scalars, logit scaling, own block names,
#: per-layer-type rotary, experts -- and one refusal.
CI_SAMPLE = ("llama", "phi3", "granite", "cohere", "gpt_neox", "gemma3_text", "mixtral", "granite_swa")


def needs(family: tiny.Family, layout: str) -> bool:
    """Whether ``family`` has the plan ``layout`` splits it by."""
    plan = cells.LAYOUTS[layout][1]
    return (plan is None or (plan == "tp" and family.tp_plan) or (plan == "pp" and family.pp_plan)
            or (plan == "both" and family.tp_plan and family.pp_plan) or (plan == "ep" and family.ep_plan))


def _say(message: str) -> None:
    print(message, flush=True)


def _run(matrix: list[tiny.Family], wanted: dict[str, list[tiny.Family]], layouts: tuple[str, ...], out: Path,
         cell_timeout: float, say: Callable[[str], None], mode: str = "sgd") -> tuple[dict, dict]:
    """``(refusals before start, runs)``: the suite's checks per cell, then one process and each layout, trained
    with the optimizer ``mode`` (the pretrained columns under SGD only)."""
    started = time.monotonic()
    plain = [layout for layout in layouts if layout not in pretrained.COLUMNS]
    refused = {(f.model_type, layout): cells.refusal(f.model_type, layout)
               for layout in plain for f in wanted[layout]}
    runs = {}
    if plain:
        runs["single"] = cells.run_layout("single", [f.model_type for f in matrix], out, cell_timeout, mode)
        say(f"{mode}: single process: {len(matrix)} families ({time.monotonic() - started:.0f} s)")
    for layout in plain:
        chosen = [f.model_type for f in wanted[layout] if not refused[f.model_type, layout]]
        runs[layout] = cells.run_layout(layout, chosen, out, cell_timeout, mode)
        say(f"{mode}: {layout}: {len(chosen)} run, {len(wanted[layout]) - len(chosen)} refused before start "
            f"({time.monotonic() - started:.0f} s)")
    folders = {layout: [f.model_type for f in wanted[layout]] for layout in layouts
               if layout in pretrained.COLUMNS and mode == "sgd"}
    if folders:  # started from save_pretrained folders: their own reference, refusals and exports
        more_refused, more_runs = pretrained.run_columns(folders, out, cell_timeout, say)
        refused.update(more_refused)
        runs.update(more_runs)
        say(f"pretrained columns done ({time.monotonic() - started:.0f} s)")
    return refused, runs


def _meta(started: float, layouts: tuple[str, ...]) -> dict[str, Any]:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__, "date": date.today().isoformat(),
            "seconds": time.monotonic() - started, "steps": cells.STEPS, "lr": cells.LR, "batch": cells.GLOBAL_BATCH,
            "seq": cells.SEQ, "tolerance": table.TOLERANCE, "machine": platform.processor() or platform.machine(),
            "layouts": list(layouts)}


def run_matrix(selected: Optional[list[str]] = None, layouts: tuple[str, ...] = tuple(table.COLUMNS),
               out: Optional[Path] = None, cell_timeout: float = cells.CELL_TIMEOUT,
               say: Callable[[str], None] = _say, resume: bool = False,
               optimizers: tuple[str, ...] = ("sgd",)) -> dict[str, Any]:
    """Run the matrix; ``{"meta", "summary", "cells", "families", "losses", "adamw"}`` are also saved as
    ``results.json``, ``"matrix"`` (the families), ``"verdicts"`` and ``"adamw_verdicts"`` are for :func:`write_docs`.

    Args:
        selected: model types (default: every causal-LM model type of the installed transformers).
        layouts: the layouts to run (of :data:`~.table.COLUMNS`); cells of the others are ``-``.
        out: the results folder (default ``benchmarks/results/<date>/hf_coverage``).
        cell_timeout: seconds for one family in one launch before it counts as hung.
        say: where progress lines go.
        resume: keep the cells already saved in ``out`` (a run that was stopped) instead of running them again.
        optimizers: ``"sgd"`` (the matrix, every column) and/or ``"adamw"`` (the plain columns again under AdamW,
            in ``out/adamw``, judged against their floors: :mod:`.adamw`).
    """
    started = time.monotonic()
    out = out or ROOT / "benchmarks" / "results" / date.today().isoformat() / "hf_coverage"
    if not resume and out.exists():
        import shutil

        shutil.rmtree(out)
    found = tiny.families(selected)
    matrix = [family for family in found if family.kind == "matrix"]
    say(f"{len(found)} causal-LM model types: {len(matrix)} in the matrix, "
        f"{sum(f.kind in ('wrapper', 'unbuildable') for f in found)} with a plan outside it")
    wanted = {layout: [f for f in matrix if needs(f, layout)] for layout in table.COLUMNS}
    needed = {layout: [f.model_type for f in wanted[layout]] if layout in layouts else [] for layout in table.COLUMNS}
    result: dict[str, Any] = {"families": [vars(f) for f in found], "matrix": found}
    refused: dict = {}
    if "sgd" in optimizers:
        refused, runs = _run(matrix, wanted, layouts, out, cell_timeout, say)
        verdicts = _judge(matrix, refused, runs, say)
        result.update(summary=table.coverage(verdicts, needed), cells=table.as_json(verdicts), verdicts=verdicts,
                      losses=_losses(runs))
    if adamw.MODE in optimizers:
        plain = tuple(layout for layout in layouts if layout in adamw.COLUMNS)
        refused_adamw, runs = _run(matrix, wanted, plain, out / adamw.MODE, cell_timeout, say, adamw.MODE)
        verdicts, floors = adamw.judge(matrix, {**refused_adamw, **refused}, runs, say)
        result["adamw"] = {"summary": adamw.coverage(verdicts, needed), "cells": table.as_json(verdicts),
                           "floors": {f"{m}/{layout}": asdict(floor) for (m, layout), floor in floors.items()},
                           "losses": _losses(runs)}
        result["adamw_verdicts"] = verdicts
    result["meta"] = {**_meta(started, layouts), "optimizers": {name: optimizer(name).describe()
                                                                 for name in optimizers}}
    out.mkdir(parents=True, exist_ok=True)
    saved = {k: v for k, v in result.items() if k not in ("matrix", "verdicts", "adamw_verdicts")}
    (out / "results.json").write_text(json.dumps(saved, indent=1, default=str))
    return result


def _losses(runs: dict) -> dict:
    """Every cell's losses (``{layout: {family: [per rank [per step]]}}``), for ``results.json``."""
    return {layout: {m: r.get("losses") for m, r in per.items() if r} for layout, per in runs.items()}


def _judge(matrix: list[tiny.Family], refused: dict, runs: dict, say: Callable[[str], None]) -> dict:
    """Every cell's verdict; the fp32 floor (:mod:`.floor`) is measured only for families with a cell off by more
    than the tolerance (a few seconds each, in this process)."""
    def cell(family: tiny.Family, layout: str, floor: Optional[float] = None) -> table.Verdict:
        from_folder = layout in pretrained.COLUMNS  # judged against one process started from from_pretrained
        judge, reference = (pretrained.verdict, pretrained.REFERENCE) if from_folder else (table.verdict, "single")
        return judge(refused.get((family.model_type, layout)), runs.get(layout, {}).get(family.model_type),
                     runs.get(reference, {}).get(family.model_type), floor)

    verdicts = {}
    for family in matrix:
        row = {layout: cell(family, layout) for layout in table.COLUMNS}
        if any(v.kind == "DEFECT" and v.figure is not None for v in row.values()):
            from benchmarks.hf_coverage.floor import fp32_floor

            floor = fp32_floor(family.model_type)
            say(f"{family.model_type}: fp32 floor {floor:.2g}")
            row = {layout: cell(family, layout, floor) for layout in table.COLUMNS}
        verdicts[family.model_type] = row
    return verdicts


def write_docs(result: dict[str, Any], path: Path = DOCS) -> None:
    """The markdown page of ``result`` (from :func:`run_matrix` with both optimizers)."""
    section = adamw.section(result["matrix"], result["adamw_verdicts"], result["adamw"]["summary"]) \
        if "adamw" in result else []
    path.write_text(table.markdown(result["meta"], result["matrix"], result["verdicts"], result["summary"], section))
