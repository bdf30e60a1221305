"""The plan as rich tables: ranked layouts (predicted, and measured when ``--measure`` ran) and refusals."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Optional

from rich.console import Console
from rich.table import Table

from lightning_parallel.planner.plan import Plan

_MB = 2**20


def _bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / _MB:.2f} MiB"


def ranked_table(plan: Plan, top: int, measured: Optional[Mapping[str, float]] = None) -> Table:
    """The ``top`` layouts, fastest predicted first; a ``measured`` column when samples/s were measured.

    ``setup/rank`` is the peak while the model is built and split (the whole model when it is built with
    storage); ``total/rank`` the larger of it and the training step's. ``cp`` is the context size and method,
    ``cp sent/step`` the bytes a rank sends per optimizer step in ring send/recv or all-to-all, and their time;
    ``ep`` the expert size, ``ep sent/step`` the bytes of its token all-to-alls (uniform router) and their time.

    Args:
        plan: the plan.
        top: rows to show.
        measured: measured samples/s by candidate name.
    """
    table = Table(title=f"lp-plan: {plan.shape.name} on {plan.world} x {plan.cluster.name} "
                        f"({len(plan.ranked)} layouts fit, {len(plan.rejected)} refused)")
    columns = ("#", "layout", "cp", "ep", "samples/s", "step", "bubble", "comm", "cp sent/step", "ep sent/step",
               "states/rank", "activations", "setup/rank", "total/rank")
    for column in columns:
        table.add_column(column, justify="left" if column == "layout" else "right")
    if measured is not None:
        table.add_column("measured samples/s", justify="right")
    for i, p in enumerate(plan.ranked[:top], 1):
        c = p.candidate
        context = f"{c.cp} {c.cp_method}" if c.cp > 1 else "1"
        sent = f"{_bytes(p.context_bytes)}, {p.context_comm * 1e3:.3g} ms" if c.cp > 1 else "-"
        tokens = f"{_bytes(p.expert_bytes)}, {p.expert_comm * 1e3:.3g} ms" if c.ep > 1 else "-"
        row = [str(i), c.name, context, str(c.ep), f"{p.throughput:.4g}", f"{p.step_time * 1e3:.4g} ms",
               f"{p.bubble:.0%}", f"{p.comm * 1e3:.3g} ms", sent, tokens, _bytes(p.memory.states),
               _bytes(p.memory.activations), _bytes(p.memory.setup), _bytes(p.memory.total)]
        if measured is not None:
            value = measured.get(p.candidate.name)
            row.append("-" if value is None else f"{value:.4g}")
        table.add_row(*row)
    return table


def rejected_table(plan: Plan, limit: int = 12) -> Table:
    """Refused layouts grouped by reason (the reason's first clause), with an example of each."""
    table = Table(title="refused layouts")
    for column in ("reason", "layouts", "example"):
        table.add_column(column)
    groups = Counter(r.reason.split(":")[0] for r in plan.rejected)
    examples = {}
    for r in plan.rejected:
        examples.setdefault(r.reason.split(":")[0], r)
    for reason, count in groups.most_common(limit):
        example = examples[reason]
        table.add_row(reason, str(count), f"{example.label}: {example.reason}")
    return table


def print_plan(plan: Plan, line: str, top: int = 10, measured: Optional[Mapping[str, float]] = None,
               console: Optional[Console] = None, best: Optional[str] = None) -> None:
    """Print the ranked table, the refusals and the winning overrides.

    Args:
        plan: the plan.
        line: the winning overrides, as one line.
        top: ranked rows to show.
        measured: measured samples/s by candidate name.
        console: where to print (stdout).
        best: the chosen layout's name (default: the predicted best).
    """
    console = console or Console(width=None if Console().is_terminal else 200)
    console.print(ranked_table(plan, top, measured))
    if plan.rejected:
        console.print(rejected_table(plan))
    console.print(f"best: {best or plan.best.candidate.name}\nrun it with:\n  lp-train {line}", soft_wrap=True)
