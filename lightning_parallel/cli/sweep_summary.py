"""Summarise a Hydra multirun: one row per job, as ``summary.csv`` in the sweep folder and a table.

Each job's rank 0 leaves ``metrics.json`` in its own output folder (the end of
:func:`lightning_parallel.cli.train.train`); :class:`SweepSummary`, registered under
``hydra.callbacks`` in ``conf/config.yaml``, collects them when the multirun ends, with
any sweeper (basic grid, Optuna) and any launcher (local, submitit).

Note:
    The callback reads files instead of the task functions' return values because the
    jobs may have run elsewhere (submitit on SLURM) and because a job that died leaves no
    return value at all: it still gets a row, marked as missing, so a sweep never looks
    complete when it is not.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table
from typing_extensions import override

METRICS_FILE = "metrics.json"
FAILURE_FILE = "failure.json"
SUMMARY_FILE = "summary.csv"

# (CSV column, table heading); the table shows the columns with a heading.
COLUMNS: list[tuple[str, Optional[str]]] = [
    ("job", "job"),
    ("strategy", "strategy"),
    ("num_nodes", None),
    ("devices", "devices"),
    ("world_size", None),
    ("layout", "layout"),
    ("scaling_rule", "rule"),
    ("micro_batch_size", None),
    ("accumulate_grad_batches", None),
    ("global_batch_size", "global batch"),
    ("lr", "eff. lr"),
    ("warmup_steps", None),
    ("val_loss", "val loss"),
    ("train_loss", None),
    ("samples_per_sec", "samples/s"),
    ("tokens_per_sec", "tokens/s"),
    ("fit_seconds", "fit s"),
    ("overrides", None),
    ("status", "status"),
]


def _job_number(path: Path) -> tuple[int, str]:
    match = re.match(r"(\d+)", path.name)
    return (int(match.group(1)) if match else 1 << 30, path.name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job folders of a sweep: those Hydra wrote a ``.hydra`` folder or a job wrote metrics into."""
    if not sweep_dir.is_dir():
        return []
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / ".hydra").is_dir() or (p / METRICS_FILE).is_file())]
    return sorted(jobs, key=_job_number)


def job_row(job_dir: Path) -> dict[str, Any]:
    """One summary row from a job folder's ``metrics.json`` (status ``missing`` without one).

    Args:
        job_dir: the job's output folder.
    """
    path = job_dir / METRICS_FILE
    if not path.is_file():
        failure = _read_json(job_dir / FAILURE_FILE)
        if failure:
            return {
                "job": job_dir.name,
                "overrides": failure.get("overrides"),
                "status": f"failed: {failure.get('error')}",
            }
        return {"job": job_dir.name, "status": f"missing {METRICS_FILE} (job failed or did not finish)"}
    data = json.loads(path.read_text())
    eff, metrics = data.get("effective", {}), data.get("metrics", {})
    return {
        "job": job_dir.name,
        "strategy": data.get("strategy"),
        "num_nodes": data.get("num_nodes"),
        "devices": data.get("devices"),
        "world_size": data.get("world_size"),
        "layout": data.get("layout"),
        "scaling_rule": eff.get("rule"),
        "micro_batch_size": eff.get("micro_batch_size"),
        "accumulate_grad_batches": eff.get("accumulate_grad_batches"),
        "global_batch_size": eff.get("global_batch_size"),
        "lr": eff.get("lr"),
        "warmup_steps": eff.get("warmup_steps"),
        "val_loss": metrics.get("val_loss"),
        "train_loss": metrics.get("train_loss"),
        "samples_per_sec": metrics.get("throughput/samples_per_sec"),
        "tokens_per_sec": metrics.get("throughput/tokens_per_sec"),
        "fit_seconds": metrics.get("time/fit_seconds"),
        "overrides": data.get("overrides"),
        "status": "ok",
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def record_failure(job_dir: Path, error: BaseException) -> Path:
    """Write ``failure.json`` into a job's folder: the first line of its error (its summary row shows it).

    Args:
        job_dir: the job's output folder.
        error: what ended the job.
    """
    from hydra.core.hydra_config import HydraConfig

    lines = str(error).strip().splitlines() or [type(error).__name__]
    overrides = HydraConfig.get().job.override_dirname if HydraConfig.initialized() else None
    path = job_dir / FAILURE_FILE
    job_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"error": lines[0], "type": type(error).__name__, "overrides": overrides}, indent=2))
    return path


def summarise(sweep_dir: Path) -> list[dict[str, Any]]:
    """Rows of every job of the sweep in ``sweep_dir``, written to ``summary.csv`` there.

    Args:
        sweep_dir: the multirun folder (``hydra.sweep.dir``).
    """
    rows = [job_row(job) for job in job_dirs(sweep_dir)]
    if sweep_dir.is_dir():
        with open(sweep_dir / SUMMARY_FILE, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=[c for c, _ in COLUMNS])
            writer.writeheader()
            writer.writerows(rows)
    return rows


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if column == "job":
        # The folder name repeats the overrides; the number is enough beside the other columns.
        return re.match(r"\d+", value).group(0) if re.match(r"\d+", value) else value
    if column == "global_batch_size":
        dp = value // (row["micro_batch_size"] * row["accumulate_grad_batches"])
        return f"{value} = {row['micro_batch_size']} x {row['accumulate_grad_batches']} x dp{dp}"
    if column == "lr":
        return f"{value:.3g}"
    if column in ("val_loss", "train_loss"):
        return f"{value:.4f}"
    if column in ("samples_per_sec", "tokens_per_sec", "fit_seconds"):
        return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"
    if column == "devices" and (row.get("num_nodes") or 1) > 1:
        return f"{row['num_nodes']} x {value}"
    return str(value)


def summary_table(rows: list[dict[str, Any]], title: str) -> Table:
    """The rich table of a sweep (the CSV has more columns).

    Args:
        rows: rows from :func:`summarise`.
        title: the table's title.
    """
    table = Table(title=title, title_justify="left")
    shown = [(column, heading) for column, heading in COLUMNS if heading]
    text_columns = ("job", "strategy", "layout", "scaling_rule", "status")
    for column, heading in shown:
        table.add_column(heading, justify="right" if column not in text_columns else "left")
    for row in rows:
        ok = row.get("status") == "ok"
        table.add_row(*(_cell(row, column) if ok or column in ("job", "status") else "-" for column, _ in shown))
    return table


class SweepSummary(Callback):
    """Hydra callback: ``summary.csv`` rewritten after every job of a multirun, the table at its end.

    A job that raised gets its row from ``failure.json`` (written here when the job's own
    handler could not); :attr:`failed_jobs` counts the rows that are not ``ok`` once the
    multirun ends, and ``lp-train`` exits with that count.

    Args:
        console_width: width of the printed table (wide enough for the sweep folder names).
    """

    failed_jobs = 0  # of the last multirun in this process (lp-train's exit code)

    def __init__(self, console_width: int = 160) -> None:
        self.console_width = console_width
        self._sweep_dir: Optional[Path] = None

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolve the folder now: its ``${now:...}`` must not be read again at a later time.
        self._sweep_dir = Path(config.hydra.sweep.dir)

    @override
    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        if job_return.status == JobStatus.FAILED and not (job_dir / FAILURE_FILE).exists():
            try:
                _ = job_return.return_value  # a failed job's return value raises its error
            except Exception as error:  # noqa: BLE001 - any error is the row's message
                record_failure(job_dir, error)
        summarise(self._sweep_dir or Path(config.hydra.sweep.dir))  # after every job: a sweep cut short keeps its rows

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = self._sweep_dir or Path(config.hydra.sweep.dir)
        rows = summarise(sweep_dir)
        failed = sum(1 for row in rows if row.get("status") != "ok")
        SweepSummary.failed_jobs = failed
        console = Console(width=self.console_width)
        console.print(summary_table(rows, f"lightning_parallel: sweep summary ({len(rows)} jobs)"))
        failures = f"  ({failed} of {len(rows)} jobs failed)" if failed else ""
        console.print(f"summary: {sweep_dir / SUMMARY_FILE}" + failures)
