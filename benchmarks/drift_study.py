"""What "equal to one process" means at length: 500 AdamW steps under each layout axis against its floor (issue 43).

    python -m benchmarks.drift_study                        # every model, every layout, 500 steps; writes the docs
    python -m benchmarks.drift_study --models gpt --steps 200 --layouts tensor2

Three models -- the GPT recipe (``examples/nlp/model.py``, width 32, 2 blocks), a Hugging Face Llama and a
Mixtral (the coverage matrix's tiny configs, 4 layers, width 32; Mixtral 4 experts, top 2) -- train ``steps``
AdamW steps (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on matrices: the coverage matrix's AdamW mode) in fp32
on right-padded byte windows of the standard library's text (global batch 8, 16 tokens), on one process and
under each layout axis: data 2 ZeRO-3, pipeline 2 (4 micro-batches), tensor 2, context 2 (ring) and, for
Mixtral, data 2 x expert 2. Each run records every step's loss and the whole model's parameters at
:data:`RECORD`.

The *floor* of a layout is one process trained in the layout's arithmetic
(:mod:`benchmarks.hf_coverage.arithmetic`: its data shards, micro-batches or tensor splits; no communication)
against one process on whole batches: how far fp32 rounding alone carries a run whose sums are reordered as the
layout reorders them. Context parallelism reorders the attention's sums (ring blocks merged by log-sum-exp) and
the weight gradients' sums over tokens (each rank's share of the sequence); the loop does not reproduce the ring,
so its floor is the data-shard order's (the same gradient sums cut in two), marked as such.

The results go to ``benchmarks/results/<date>/drift_study.json`` and, for a full run, between the markers of the
section "What equal means at length" in ``docs/testing.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from benchmarks.drift_runs import LAYOUTS, MODELS, RECORD, STEPS, floor_run, layout_run, recorded_steps

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- drift-study:begin -->", "<!-- drift-study:end -->"
WINDOWS = (100, 200, 500)


def _difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


def compare(run: dict[str, Any], reference: dict[str, Any], steps: int) -> dict[str, Any]:
    """A run against the one-process run: the largest loss difference up to each window's end, the largest
    parameter difference at each recorded step."""
    losses = [abs(a - b) for a, b in zip(run["losses"], reference["losses"])]
    return {"loss": {str(end): max(losses[:end]) for end in WINDOWS if end <= steps} | {"all": max(losses)},
            "parameters": {str(step): _difference(run["parameters"][step], reference["parameters"][step])
                           for step in recorded_steps(steps)}}


def study(models: list[str], layouts: list[str], steps: int, say=print) -> dict[str, Any]:
    """Run the study; ``{model: {layout: {"run": ..., "floor": ..., "floor_kind"}, "reference_gap"}}``."""
    results: dict[str, Any] = {}
    for model in models:
        started = time.monotonic()
        reference = layout_run(model, "single", steps)
        whole = floor_run(model, "single", steps)
        gap = _difference(whole["parameters"][steps], reference["parameters"][steps])
        results[model] = {"reference_gap": gap, "final_loss": reference["losses"][-1],
                          "first_loss": reference["losses"][0]}
        say(f"{model}: one process {time.monotonic() - started:.0f} s; its loop reproduces it to {gap:.2g}")
        for layout in [name for name in layouts if name in MODELS[model].layouts]:
            run = layout_run(model, layout, steps)
            ordered = floor_run(model, layout, steps)
            results[model][layout] = {"run": compare(run, reference, steps), "floor": compare(ordered, whole, steps),
                                      "floor_kind": LAYOUTS[layout].floor_kind}
            row = results[model][layout]
            say(f"{model} {layout}: parameters {row['run']['parameters'][str(steps)]:.2g} off one process after "
                f"{steps} steps (floor {row['floor']['parameters'][str(steps)]:.2g}), losses up to "
                f"{row['run']['loss']['all']:.2g} ({time.monotonic() - started:.0f} s)")
    return results


def markdown(results: dict[str, Any], steps: int, meta: dict[str, Any]) -> str:
    """The docs section: one row per model and layout, parameters and loss against the floor at each window."""
    windows = [str(end) for end in WINDOWS if end <= steps] or [str(steps)]
    lines = [BEGIN, "", f"Measured by `python -m benchmarks.drift_study` on {meta['date']} ({meta['seconds']:.0f} s"
             " on this machine's CPUs), torch " + meta["torch"] + ". Max |parameter - one process| after "
             + ", ".join(windows) + " steps, the same for the floor (one process in the layout's arithmetic against "
             "one process on whole batches), and the largest loss difference over the run.", "",
             "| model | layout | " + " | ".join(f"parameters at {w} (floor)" for w in windows)
             + " | loss, any step | floor order |", "|---|---|" + "---|" * (len(windows) + 2)]
    for model, rows in results.items():
        for layout, row in rows.items():
            if not isinstance(row, dict):
                continue
            cells = [f"{row['run']['parameters'][w]:.1e} ({row['floor']['parameters'][w]:.1e})" for w in windows]
            lines.append(f"| {model} | {LAYOUTS[layout].label} | " + " | ".join(cells)
                         + f" | {row['run']['loss']['all']:.1e} | {row['floor_kind']} |")
    lines += ["", END]
    return "\n".join(lines)


def write_docs(section: str, path: Path = DOCS) -> None:
    """Replace the text between the markers of ``path`` by ``section`` (the markers included)."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    path.write_text(text[:start] + section + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drift_study", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/results/<date>/drift_study.json)")
    args = parser.parse_args(argv)
    models, layouts = args.models.split(","), args.layouts.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown models or layouts {unknown}")
    started = time.monotonic()
    results = study(models, layouts, args.steps)
    meta = {"date": date.today().isoformat(), "seconds": time.monotonic() - started, "torch": torch.__version__,
            "steps": args.steps, "record": [s for s in RECORD if s <= args.steps]}
    out = args.out or ROOT / "benchmarks" / "results" / meta["date"] / "drift_study.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    section = markdown(results, args.steps, meta)
    print(section)
    if args.models == ",".join(MODELS) and args.layouts == ",".join(LAYOUTS) and args.steps == STEPS:
        write_docs(section)
        print(f"wrote {DOCS}")


if __name__ == "__main__":
    main()
