"""The tables rank 0 prints: what a run is about to do, and what it did."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.scaling import EffectiveHparams


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    return table


def startup_rows(
    strategy_name: str,
    layout: ParallelLayout,
    hparams: EffectiveHparams,
    reference: Optional[Mapping[str, Any]],
    accelerator: str,
    num_nodes: int,
    paths: Mapping[str, str],
    extra: Optional[Mapping[str, str]] = None,
) -> list[tuple[str, str]]:
    """Rows of the start-up table.

    Args:
        strategy_name: class or registry name of the strategy.
        layout: the resolved data x pipeline x tensor layout.
        hparams: effective batch / accumulation / lr / warm-up after rescaling.
        reference: the scaling reference (None when the rule is ``none``).
        accelerator: ``cpu`` or ``cuda``.
        num_nodes: nodes in the run.
        paths: ``output``, ``logs`` and ``checkpoints`` folders.
        extra: strategy-specific rows (pipeline split, rank map, ...).
    """
    rows = [
        ("strategy", strategy_name),
        ("world size", f"{layout.world_size} ({num_nodes} node(s) x {layout.world_size // max(num_nodes, 1)} {accelerator} process(es))"),
        ("layout", f"{layout.describe()}  (data x pipeline x tensor; only data multiplies the batch)"),
    ]
    rows += scaling_rows(hparams, reference)
    rows += list((extra or {}).items())
    rows += [(f"{name} dir", str(path)) for name, path in paths.items()]
    return rows


def scaling_rows(hparams: EffectiveHparams, reference: Optional[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Rows that put the effective batch, accumulation, lr and warm-up beside the reference.

    Args:
        hparams: effective values after rescaling.
        reference: ``scaling.reference`` (ignored by the ``none`` rule).
    """
    h = hparams
    rows = [("scaling rule", h.rule)]
    ref = dict(reference or {}) if h.rule != "none" else {}
    if ref:
        devices = f" on {ref['devices']} data-parallel device(s)" if ref.get("devices") else ""
        rows.append(("reference", f"global batch {ref.get('global_batch_size')}, lr {ref.get('lr')}, warm-up {ref.get('warmup_steps')}{devices}"))
    rows += [
        ("micro-batch / device", str(h.micro_batch_size)),
        ("gradient accumulation", str(h.accumulate_grad_batches)),
        ("global batch", f"{h.global_batch_size} = {h.micro_batch_size} x {h.accumulate_grad_batches} x dp{h.data_parallel}"
         + (f"  (reference {ref['global_batch_size']})" if ref else "")),
        ("learning rate", f"{h.lr:.4g}" + (f"  (reference {ref['lr']}, x{h.lr / ref['lr']:.4g})" if ref.get("lr") else "")),
        ("warm-up steps", str(h.warmup_steps) + (f"  (reference {ref.get('warmup_steps')})" if ref else "")),
    ]  # fmt: skip
    return rows


def print_table(title: str, rows: list[tuple[str, str]], console: Optional[Console] = None) -> None:
    """Print a two-column table (rank 0 only: the caller decides)."""
    (console or Console(width=140)).print(_table(title, rows))


def rank_map_rows(layout: ParallelLayout, limit: int = 16) -> dict[str, str]:
    """The rank map: which global ranks form each tensor, pipeline and data group.

    Args:
        layout: the resolved layout.
        limit: groups shown per axis before eliding.
    """
    from lightning_parallel.layout import DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL

    rows = {}
    for label, axis in (("tensor groups", TENSOR_PARALLEL), ("pipeline groups", PIPELINE_PARALLEL), ("data groups", DATA_PARALLEL)):
        groups = sorted({tuple(layout.group_ranks(axis, rank)) for rank in range(layout.world_size)})
        if len(groups[0]) == 1:
            continue
        shown = " ".join(str(list(g)) for g in groups[:limit]) + (" ..." if len(groups) > limit else "")
        rows[label] = shown
    rows["rank -> (data, pipeline, tensor)"] = " ".join(f"{r}:{tuple(c)}" for r, c in layout.rank_map()[: limit * 2])
    return rows
