"""Verdicts of the coverage matrix's cells and the markdown page they make (``docs/hf-coverage.md``).

A cell is ``PARITY`` when every rank's loss at every step is within :data:`TOLERANCE` of the single
process's and so is every final parameter (the figure is the larger difference); ``REFUSED`` when the
suite's checks refused it before any process started (the cause is the message's first sentence);
``DEFECT`` when it failed or hung after the processes started, or trained to other numbers (silently
wrong); ``-`` when the family has no plan for the layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

TOLERANCE = 1e-5
COLUMNS = {"tp2": "tensor 2", "pp2": "pipeline 2", "pp2xtp2": "pipeline 2 x tensor 2", "dp2_zero2": "data 2 ZeRO-2",
           "dp2_ep2": "data 2 x expert 2",
           # started from a save_pretrained folder, exported back (benchmarks/hf_coverage/pretrained.py)
           "pretrained_tp2": "pretrained tensor 2", "pretrained_dp2_ep2": "pretrained data 2 x expert 2"}

# How the pretrained columns are made and judged (benchmarks/hf_coverage/pretrained.py), for the page.
PRETRAINED_NOTE = [
    "The two *pretrained* columns start from a folder instead: `save_pretrained` of the family's tiny model,",
    "randomly initialised from another seed than the suite's own initialisation (a rank that read nothing would",
    "keep other values), given to the recipe as `pretrained=` (what `lp-train",
    "model.pretrained=DIR` does: the model is built on `meta`, split, and each rank reads only its slices of the",
    "folder), trained under tensor 2 and (families with `base_model_ep_plan`) data 2 x expert 2 against one",
    "process started from `from_pretrained` of the same folder. PARITY there also needs every loaded parameter,",
    "gathered before the first step, to equal `from_pretrained`'s exactly, and `from_pretrained` of the trained",
    "sharded checkpoint exported with `lp-convert --to hf` to hold, within the tolerance, what transformers",
    "gives back for the one-process trained model (`from_pretrained` of its `save_pretrained`: the two differ",
    "where a family's loader rewrites a loaded weight, as Youtu's zeroes the embedding's padding row); at the",
    "fp32 floor, no farther than the trained model itself. The figure is the larger of the training and export",
    "differences. REFUSED also covers a folder the suite's preflight (`match_folder`, on `meta`) refuses.",
]


@dataclass(frozen=True)
class Verdict:
    """One cell: ``kind`` is PARITY, REFUSED, DEFECT or NA; ``figure`` the largest difference (PARITY, wrong
    numbers); ``cause`` the message (REFUSED, DEFECT)."""

    kind: str
    figure: Optional[float] = None
    cause: str = ""
    floor: Optional[float] = None  # the family's floor under the layout's arithmetic, when it was measured (AdamW)

    def short(self) -> str:
        if self.kind == "PARITY" and self.floor is not None:
            return f"PARITY {self.figure:.1e} (floor {self.floor:.1e})"
        if self.kind == "PARITY":
            return f"PARITY {self.figure:.1e}" + (" (fp32 floor)" if self.cause else "")
        if self.kind == "NA":
            return "-"
        return f"{self.kind}: {_first_sentence(self.cause)}"


def _first_sentence(message: str, limit: int = 110) -> str:
    text = " ".join(message.split()).replace("|", "/")
    cut = text.find(": the suite") if ": the suite" in text else -1
    sentence = text[: cut if cut > 0 else None].split(". ")[0]
    return sentence if len(sentence) <= limit else sentence[: limit - 3] + "..."


def largest_difference(run: dict[str, Any], reference: dict[str, Any]) -> tuple[float, str]:
    """The largest loss (any rank, any step) or final-parameter difference, and where it is."""
    ref_losses = reference["losses"][0]
    worst, where = 0.0, ""
    for rank, losses in enumerate(run["losses"]):
        if len(losses) != len(ref_losses):
            return math.inf, f"rank {rank} recorded {len(losses)} losses, not {len(ref_losses)}"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            if not abs(a - b) <= worst:
                worst, where = abs(a - b), f"loss of step {step} on rank {rank}"
    diff, name = parameter_difference(run["parameters"] or {}, reference["parameters"] or {})
    return (diff, f"final {name}" if math.isfinite(diff) else name) if not diff <= worst else (worst, where)


def parameter_difference(params: dict[str, Any], ref_params: dict[str, Any]) -> tuple[float, str]:
    """The largest difference between two ``{name: tensor}`` sets and the name it is at (``inf`` and the cause
    when their names or shapes differ)."""
    missing = sorted(set(ref_params) ^ set(params))
    if missing:
        return math.inf, f"parameters {missing[:3]} are not in both runs"
    worst, where = 0.0, ""
    for name, value in params.items():
        if value.shape != ref_params[name].shape:
            return math.inf, f"{name} has shape {tuple(value.shape)}, not {tuple(ref_params[name].shape)}"
        diff = float((value - ref_params[name]).abs().max()) if value.numel() else 0.0
        if not diff <= worst:
            worst, where = diff, name
    return worst, where


def _first_step(run: dict[str, Any], reference: dict[str, Any]) -> float:
    """The largest difference after the first optimizer step: the first two losses and the parameters."""
    early = {"losses": [losses[:2] for losses in run["losses"]], "parameters": run.get("first_step_parameters")}
    ref = {"losses": [reference["losses"][0][:2]], "parameters": reference.get("first_step_parameters")}
    return largest_difference(early, ref)[0] if early["parameters"] and ref["parameters"] else math.inf


def verdict(refused: Optional[str], run: Optional[dict[str, Any]], reference: Optional[dict[str, Any]],
            floor: Optional[float] = None) -> Verdict:
    """The cell's verdict from its refusal, its run and the single process's run.

    Args:
        refused: the suite's refusal before start, if any.
        run, reference: the layout's and the single process's results (losses, final and first-step parameters).
        floor: the family's fp32 floor (:func:`~.floor.fp32_floor`), when it was measured. A cell off by more
            than :data:`TOLERANCE` after the last step is PARITY "at the fp32 floor" only when it is within the
            tolerance after the first step and the family's own floor is at least a tenth of the tolerance
            (well-conditioned families sit near 1e-8: Llama 7e-9); otherwise DEFECT.
    """
    if refused:
        return Verdict("REFUSED", cause=refused)
    if run is None:
        return Verdict("NA")
    if "defect" in run:
        return Verdict("DEFECT", cause=f"after start: {run['defect']}")
    if reference is None or "defect" in reference:
        return Verdict("DEFECT", cause="the single-process reference failed")
    worst, where = largest_difference(run, reference)
    if worst <= TOLERANCE:
        return Verdict("PARITY", worst)
    first = _first_step(run, reference)
    if floor is not None and floor >= TOLERANCE / 10 and first <= TOLERANCE:
        return Verdict("PARITY", worst, f"at the fp32 floor: {first:.1g} off after step 1, {worst:.2g} after the "
                       f"last ({where}); one process on half batches is {floor:.2g} off itself")
    return Verdict("DEFECT", worst, f"silently wrong: {worst:.3g} off one process ({where})")


def coverage(rows: dict[str, dict[str, Verdict]], needs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Per layout: the families that need it (have its plan), how many are PARITY, REFUSED, DEFECT, and the share."""
    out = {}
    for layout in COLUMNS:
        cells = [rows[family][layout] for family in needs[layout]]
        counts = {kind: sum(cell.kind == kind for cell in cells) for kind in ("PARITY", "REFUSED", "DEFECT")}
        share = counts["PARITY"] / len(cells) if cells else 0.0
        out[layout] = {"families": len(cells), **counts, "parity_share": round(share, 4)}
    return out


def markdown(meta: dict[str, Any], families: list[Any], rows: dict[str, dict[str, Verdict]],
             summary: dict[str, dict[str, Any]], extra: Sequence[str] = ()) -> str:
    """The page ``docs/hf-coverage.md``: how it was made, the shares, the matrix, ``extra`` (the AdamW section,
    :func:`~.adamw.section`), refusals and defects in full, and the families outside the matrix with the reason."""
    lines = [
        "# Hugging Face coverage matrix", "",
        f"Generated by `python -m benchmarks.hf_coverage` with transformers {meta['transformers']}, torch "
        f"{meta['torch']}, on {meta['date']} ({meta['seconds']:.0f} s on this machine's CPUs). Do not edit by hand.",
        "",
        "Every causal-LM model type of the installed transformers whose config carries a `base_model_tp_plan` or a",
        "`base_model_pp_plan`, built from its config class at a tiny size (4 layers, width 32, vocabulary 128;",
        "scalars around the block chain set away from 1), held by the recipe's `HFCausalLM` with no glue, trained",
        f"{meta['steps']} SGD steps (lr {meta['lr']:g}) on right-padded documents with masked prompts (global batch",
        f"{meta['batch']}, {meta['seq']} tokens) under each layout against one process (data 2 x expert 2: the",
        "families whose config carries `base_model_ep_plan`, 4 experts, top 2). **PARITY**: every rank's loss",
        f"at every step and every final parameter within {TOLERANCE:g} of one process (the figure is the largest",
        "difference). A family that amplifies fp32 rounding to near that in one process (the same process on its",
        "batches split in two halves ends at least a tenth of the tolerance from itself, where well-conditioned",
        "families end near 1e-8: `benchmarks/hf_coverage/floor.py`)",
        "is PARITY *(fp32 floor)* when every loss and parameter is within the tolerance after the first step; the",
        "figures are listed below.",
        "**REFUSED**: the suite's checks refused it before any process started (cause below). **DEFECT**: it",
        "failed, hung or trained to other numbers after start. `-`: the family has no plan for that layout.", "",
        *PRETRAINED_NOTE, "",
        "| layout | families with the plan | PARITY | REFUSED | DEFECT | PARITY share |", "|---|---|---|---|---|---|",
    ]
    for layout, name in COLUMNS.items():
        row = summary[layout]
        lines.append(f"| {name} | {row['families']} | {row['PARITY']} | {row['REFUSED']} | {row['DEFECT']} | "
                     f"{100 * row['parity_share']:.0f}% |")
    lines += ["", "| model type | class | " + " | ".join(COLUMNS.values()) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]
    for family in families:
        if family.kind == "matrix":
            cells = [rows[family.model_type][layout].short() for layout in COLUMNS]
            lines.append(f"| {family.model_type} | {family.causal_lm} | " + " | ".join(cells) + " |")
    lines += ["", *extra, "", "## Refusals, defects and fp32 floors in full (SGD)", ""] if extra else \
        ["", "## Refusals, defects and fp32 floors in full", ""]
    for family in families:
        for layout in COLUMNS:
            cell = rows.get(family.model_type, {}).get(layout)
            if cell is not None and (cell.kind in ("REFUSED", "DEFECT") or cell.cause):
                lines.append(f"- **{family.model_type}**, {COLUMNS[layout]}, {cell.kind}: "
                             f"{' '.join(cell.cause.split())}")
    lines += ["", "## Not in the matrix", "",
              "Families with a plan that cannot be built from their config class alone at a tiny size:", ""]
    for family in families:
        if family.kind in ("wrapper", "unbuildable"):
            lines.append(f"- **{family.model_type}** ({family.causal_lm}): {family.kind}: {family.reason}")
    return "\n".join(lines) + "\n"


def as_json(verdicts: dict[str, dict[str, Verdict]]) -> dict[str, dict[str, dict[str, Any]]]:
    """The verdicts as plain values (for ``results.json``)."""
    return {family: {layout: asdict(cell) for layout, cell in cells.items()} for family, cells in verdicts.items()}
