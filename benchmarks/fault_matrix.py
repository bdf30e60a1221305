"""The fault matrix: one fault at one moment under one layout per trial, and what became of the run.

``python -m benchmarks.fault_matrix [--layouts pipeline,tensor] [--faults kill,hang] [--timeout 10] [--out DIR]``
runs every trial of :func:`trials` (2 processes each, a tiny model, 8 AdamW steps, a checkpoint every 2 steps, the
strategy's collective ``timeout``) and writes ``fault_matrix.json`` and ``fault_matrix.md`` (the table of
docs/fault-matrix.md). Each trial is classified (:func:`classify`) as

* ``trained on`` -- every rank finished every step, with the uninterrupted run's losses;
* ``stopped, resumed`` -- the run stopped (an error on every surviving rank, or a SIGINT/SIGTERM stop), and the
  checkpoint the resume logic picks (``lp-train``'s ``ckpt_path=last``: the furthest ``last*.ckpt``) resumes to the
  uninterrupted run's losses; ``lost`` is the steps trained again;
* ``refused`` -- a resume from a damaged checkpoint stopped before any step with an error naming a file of it;

and the failures the matrix exists to find: ``HANG`` (a rank still running ``timeout`` + :data:`HANG_MARGIN_S`
after the fault), ``CORRUPT LATEST`` (the picked checkpoint does not resume), ``SILENT`` (a finished or resumed run
whose losses differ from the uninterrupted run's by more than :data:`TOLERANCE`), ``UNCLEAR`` (stopped, but no
surviving rank's error says why).
"""

from __future__ import annotations

import argparse
import json
import pickle
import queue
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.fault_trial import LAYOUTS, STEPS, train_rank

FAULT_STEP = 5  # forward/backward/optimizer faults: the checkpoint before is step 4, so 1 step is trained again
SAVE_STEP = 4  # the save a fault hits (the one before it is step 2)
FAULTED_RANK = 1
RESUMED_STEP = 4  # resume trials start from the reference's step-4 checkpoint
MARK = "Where the ranks were"
NOTE = "Reading the checkpoint"
HANG_MARGIN_S = 30.0  # start-up and the gloo timeout's own slack on 2 shared cores
TOLERANCE = 1e-6
# (fault, moment) pairs of the matrix: every fault where it can happen.
PAIRS = (
    ("kill", "start-up"), ("kill", "forward"), ("kill", "backward"), ("kill", "optimizer_step"), ("kill", "save"),
    ("kill", "resume"), ("hang", "backward"), ("hang", "optimizer_step"), ("hang", "save"), ("slow", "forward"),
    ("nan", "backward"), ("sigterm", "forward"), ("sigint", "optimizer_step"), ("truncate", "resume"),
    ("delete", "resume"), ("disk_full", "save"),
)
# The error texts that say what happened (a rank named, the non-finite step, the file, the write that failed).
CLEAR = ("Where the ranks were", "Non-finite gradients", "exited with code", "No such file", "File too large",
         "No space", "checkpoint", "Checkpoint", "Rank ", "rank ")


@dataclass(frozen=True)
class Trial:
    """One cell: ``fault`` at ``moment`` under ``layout`` (fired on rank 1)."""

    layout: str
    fault: str
    moment: str


def trials(layouts: Optional[list[str]] = None, faults: Optional[list[str]] = None) -> list[Trial]:
    """Every (layout, fault, moment) of the matrix, optionally only some layouts or faults."""
    return [Trial(layout, fault, moment) for layout in (layouts or list(LAYOUTS)) for fault, moment in PAIRS
            if faults is None or fault in faults]


def _point(trial: Trial, stamp: Path, checkpoint: Optional[str]) -> Any:
    from lightning_parallel.testing.fault_points import FaultPoint

    step = SAVE_STEP if trial.moment == "save" else FAULT_STEP
    return FaultPoint(trial.fault, trial.moment, rank=FAULTED_RANK, step=step, stamp=str(stamp), checkpoint=checkpoint)


def _wait(procs: list[Any], results: Any, stamp: Path, timeout_s: float, budget_s: float) -> dict[str, Any]:
    """Every rank's fate: its value, its error (traceback) or exit code; ``hung``: the ranks other than the faulted
    one (rank 1) still running ``timeout_s`` + :data:`HANG_MARGIN_S` after the fault (``lp-train``'s launcher and
    torchrun end the run at the first rank that fails, so a rank hung on purpose is ended by them, not counted)."""
    start, fates = time.time(), {}
    others = [rank for rank in range(len(procs)) if rank != FAULTED_RANK]
    while len(fates) < len(procs):
        fired = float(stamp.read_text()) if stamp.exists() else None
        limit = (fired + timeout_s + HANG_MARGIN_S) if fired else start + budget_s
        if time.time() > limit or (all(r in fates for r in others) and time.time() > max(f["t"] for f in
                                                                                          fates.values()) + 3):
            break
        try:
            rank, ok, value = results.get(timeout=0.5)
            fates[rank] = {"ok": ok, "value": pickle.loads(value) if ok else value, "t": time.time()}
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in fates and proc.exitcode not in (None, 0):
                    fates[rank] = {"ok": False, "value": f"exited with code {proc.exitcode}", "t": time.time()}
    return {"fates": fates, "hung": [r for r in others if r not in fates],
            "fired": float(stamp.read_text()) if stamp.exists() else None}


def launch(layout: str, workdir: Path, timeout_s: float, point: Any = None, ckpt_path: Optional[str] = None,
           budget_s: float = 240.0) -> dict[str, Any]:
    """Run :func:`~benchmarks.fault_trial.train_rank` on the layout's ranks and wait for each (see :func:`_wait`)."""
    from lightning_parallel.testing.processes import start_ranks, stop_ranks

    stamp = Path(point.stamp) if point is not None else workdir / "no-fault"
    procs, results = start_ranks(train_rank, LAYOUTS[layout].world_size,
                                 (layout, str(workdir / "checkpoints"), timeout_s, point, ckpt_path), {},
                                 {"LP_STOP_GRACE_S": "30"})
    try:
        return _wait(procs, results, stamp, timeout_s, budget_s)
    finally:
        stop_ranks(procs, finished=False)


def _max_difference(losses: list[float], reference: list[float], first_step: int) -> float:
    expected = reference[first_step:first_step + len(losses)]
    return max((abs(a - b) for a, b in zip(losses, expected)), default=0.0)


def _error(run: dict[str, Any]) -> str:
    """The most telling line of the survivors' errors (the last line of a traceback, notes included)."""
    texts = [f["value"] for r, f in sorted(run["fates"].items()) if not f["ok"]]
    for text in texts:
        lines = [line for line in str(text).strip().splitlines() if line.strip()]
        noted = [i for i, line in enumerate(lines) if line.startswith(NOTE) and i > 0]
        if noted:  # the error, then the note that names the damaged checkpoint
            return f"{lines[noted[0] - 1].strip()[:120]} {lines[noted[0]].strip()}"[:300]
        telling = [line[line.index(MARK):] for line in lines if MARK in line] or lines[-1:]
        if telling and "exited with code" not in telling[0]:
            return telling[0].strip()[:300]
    return str(texts[0])[:300] if texts else ""


def _resume_check(trial: Trial, workdir: Path, timeout_s: float, reference: list[float], trained: int,
                  row: dict[str, Any]) -> dict[str, Any]:
    """Resume from the checkpoint ``lp-train``'s ``ckpt_path=last`` would pick and compare with the reference."""
    from lightning_parallel.cli.run_resume import last_checkpoint

    last = last_checkpoint(workdir / "checkpoints")
    resumed = launch(trial.layout, workdir, timeout_s, None, str(last) if last else None)
    row["resumed_from"] = last.name if last else "scratch"
    values = [f["value"] for f in resumed["fates"].values() if f["ok"]]
    if resumed["hung"] or len(values) < LAYOUTS[trial.layout].world_size:
        return {**row, "outcome": "CORRUPT LATEST", "error": _error(resumed) or "resume hung"}
    first = values[0]["first_step"]
    difference = _max_difference(values[0]["losses"], reference, first)
    outcome = "stopped, resumed" if difference <= TOLERANCE else "SILENT"
    return {**row, "outcome": outcome, "lost": max(0, trained - first), "max_diff": difference}


def classify(trial: Trial, run: dict[str, Any], reference: list[float], workdir: Path,
             timeout_s: float) -> dict[str, Any]:
    """The trial's table row: outcome, time from the fault to the first survivor's error, steps lost, loss gap."""
    row: dict[str, Any] = {**asdict(trial), "fired": run["fired"] is not None, "detect_s": None, "lost": None,
                           "max_diff": None, "resumed_from": None, "error": _error(run)}
    failed = [f["t"] for f in run["fates"].values() if not f["ok"] and "exited with code 17" not in str(f["value"])]
    if run["fired"] and failed:
        row["detect_s"] = round(min(failed) - run["fired"], 1)
    if run["hung"]:
        return {**row, "outcome": "HANG", "error": f"ranks {run['hung']} still running"}
    values = [f["value"] for f in run["fates"].values() if f["ok"]]
    if len(values) == LAYOUTS[trial.layout].world_size and values[0]["stopped_at"] is None:
        difference = _max_difference(values[0]["losses"], reference, values[0]["first_step"])
        outcome = "trained on" if difference <= TOLERANCE else "SILENT"
        return {**row, "outcome": outcome, "lost": 0, "max_diff": difference}
    if trial.fault in ("truncate", "delete"):
        trained = any(v["losses"] for v in values)
        clear = any(word in row["error"] for word in (".distcp", ".pt", ".ckpt", "checkpoint", "No such file"))
        outcome = "SILENT" if trained else ("refused" if clear else "UNCLEAR")
        return {**row, "outcome": outcome, "lost": 0}
    if values and values[0]["stopped_at"] is not None:
        return _resume_check(trial, workdir, timeout_s, reference, values[0]["stopped_at"], row)
    if not any(word in row["error"] for word in CLEAR):
        row["unclear"] = True
    trained = {"save": SAVE_STEP, "start-up": 0, "resume": RESUMED_STEP}.get(trial.moment, FAULT_STEP)
    checked = _resume_check(trial, workdir, timeout_s, reference, trained, row)
    return {**checked, "outcome": "UNCLEAR"} if row.get("unclear") and checked["outcome"] == "stopped, resumed" \
        else checked


def run_trial(trial: Trial, root: Path, timeout_s: float, reference: dict[str, Any]) -> dict[str, Any]:
    """Run one trial in its own folder under ``root`` (a resume trial starts from the reference's step-4 save)."""
    workdir = root / "-".join(part.replace(" ", "_").replace("(", "").replace(")", "")
                              for part in (trial.layout, trial.fault, trial.moment))
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "checkpoints").mkdir(parents=True)
    ckpt_path = None
    if trial.moment == "resume":
        source = Path(reference["dir"]) / "checkpoints" / f"step={RESUMED_STEP}.ckpt"
        target = workdir / "checkpoints" / "last.ckpt"
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, target)
        ckpt_path = str(target)
    started = time.time()
    run = launch(trial.layout, workdir, timeout_s, _point(trial, workdir / "stamp", ckpt_path), ckpt_path)
    if run["fired"] is None and "EADDRINUSE" in _error(run):  # another process took the free port first: again
        run = launch(trial.layout, workdir, timeout_s, _point(trial, workdir / "stamp", ckpt_path), ckpt_path)
    row = classify(trial, run, reference["losses"], workdir, timeout_s)
    return {**row, "wall_s": round(time.time() - started, 1)}


def reference_run(layout: str, root: Path, timeout_s: float) -> dict[str, Any]:
    """The uninterrupted run of ``layout``: its losses and its checkpoints (``step=2.ckpt`` ... ``step=8.ckpt``)."""
    workdir = root / ("reference-" + layout.replace(" ", "_").replace("(", "").replace(")", ""))
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "checkpoints").mkdir(parents=True)
    run = launch(layout, workdir, timeout_s)
    values = [f["value"] for f in run["fates"].values() if f["ok"]]
    if run["hung"] or len(values) < LAYOUTS[layout].world_size or len(values[0]["losses"]) != STEPS:
        raise RuntimeError(f"The reference run of {layout!r} did not finish: {_error(run) or run['hung']}")
    return {"losses": values[0]["losses"], "dir": str(workdir)}


def run_matrix(selected: list[Trial], root: Path, timeout_s: float, out: Path) -> list[dict[str, Any]]:
    """Run ``selected`` (one reference run per layout first), writing the JSON and the table after every trial."""
    from benchmarks.fault_matrix_report import markdown

    references: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    for trial in selected:
        if trial.layout not in references:
            try:
                references[trial.layout] = reference_run(trial.layout, root, timeout_s)
            except RuntimeError as error:  # the layout's own run failed: its trials say so and the rest go on
                references[trial.layout] = {"error": str(error)[:300]}
        reference = references[trial.layout]
        rows.append(run_trial(trial, root, timeout_s, reference) if "error" not in reference else
                    {**asdict(trial), "outcome": "NOT RUN", "fired": False, "error": reference["error"]})
        print(json.dumps(rows[-1]), flush=True)
        (out / "fault_matrix.json").write_text(json.dumps(rows, indent=1))
        (out / "fault_matrix.md").write_text(markdown(rows, timeout_s))
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m benchmarks.fault_matrix``: the whole matrix, or the layouts and faults named."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--faults", help="comma-separated fault kinds (default: all)")
    parser.add_argument("--timeout", type=float, default=10.0, help="the strategies' collective timeout (s)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fault_matrix"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lp_fault_matrix"))
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",") if args.layouts else None
    unknown = sorted(set(layouts or []) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layouts {unknown}: choose from {list(LAYOUTS)}")
    run_matrix(trials(layouts, args.faults.split(",") if args.faults else None), args.workdir, args.timeout, args.out)


if __name__ == "__main__":
    main()
