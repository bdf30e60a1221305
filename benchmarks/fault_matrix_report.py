"""The fault matrix's totals and its Markdown table (docs/fault-matrix.md shows one)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

FAILURES = ("HANG", "CORRUPT LATEST", "SILENT", "UNCLEAR")


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Trials, outcomes, the failures the matrix looks for, detection times and steps lost."""
    detect = [row["detect_s"] for row in rows if row.get("detect_s") is not None]
    lost = [row["lost"] for row in rows if row.get("lost") is not None]
    outcomes = Counter(row["outcome"] for row in rows)
    return {
        "trials": len(rows), "outcomes": dict(sorted(outcomes.items())),
        "failures": {name: outcomes.get(name, 0) for name in FAILURES},
        "not_fired": sum(1 for row in rows if not row.get("fired")),
        "detect_s": {"median": statistics.median(detect), "max": max(detect)} if detect else None,
        "lost_steps": {"max": max(lost), "total": sum(lost)} if lost else None,
    }


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.1e}" if value and abs(value) < 0.01 else f"{value:g}"
    return str(value).replace("|", "/")


def markdown(rows: list[dict[str, Any]], timeout_s: float) -> str:
    """The totals as a sentence and every trial as a table row."""
    summary = totals(rows)
    detect = summary["detect_s"] or {"median": "-", "max": "-"}
    lines = [
        f"{summary['trials']} trials (collective timeout {timeout_s:g} s): "
        + ", ".join(f"{count} {name}" for name, count in summary["outcomes"].items())
        + f". Hangs past the timeout: {summary['failures']['HANG']}; corrupt latest checkpoints: "
        f"{summary['failures']['CORRUPT LATEST']}; silent differences: {summary['failures']['SILENT']}; "
        f"stopped without a clear error: {summary['failures']['UNCLEAR']}. Fault to the first surviving rank's error: "
        f"median {detect['median']} s, max {detect['max']} s.",
        "",
        "| layout | fault | moment | outcome | detected (s) | steps lost | resumed from | loss diff | "
        "what the user saw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        outcome = row["outcome"] + ("" if row.get("fired") else " (not fired)")
        cells = [row["layout"], row["fault"], row["moment"], outcome,
                 row.get("detect_s"), row.get("lost"), row.get("resumed_from"), row.get("max_diff"),
                 (row.get("error") or "")[:160]]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"
