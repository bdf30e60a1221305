"""Hydra entry point: compose -> rescale -> instantiate -> fit -> report.

Run ``python -m lightning_parallel.cli.train`` (or ``lp-train``) with Hydra overrides, e.g.
``lp-train strategy=pipeline trainer.devices=2`` or
``lp-train -m strategy=ddp trainer.devices=1,2``. With ``trainer.devices > 1`` and no
external launcher (torchrun, SLURM) the entry point starts the other local ranks itself
(see :mod:`lightning_parallel.cli.launch`).

The edges of a run: every run gets its own folder (:mod:`lightning_parallel.cli.run_folder`);
``ckpt_path=last`` and ``resume=<folder>`` are resolved before anything starts
(:mod:`lightning_parallel.cli.run_resume`); Ctrl-C/SIGTERM stop every rank at one step with a checkpoint
(:mod:`lightning_parallel.runtime.signals`); every error is one line with its remedy (the traceback goes to
the run's ``train.log``); a multirun exits with the number of jobs that failed.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.effective import apply_scaling as apply_scaling  # re-exported: tests use it
from lightning_parallel.cli.effective import run_summary, save_effective_config
from lightning_parallel.cli.preflight import ConfigError, check_trainer_overrides, preflight, report_config_error
from lightning_parallel.cli.preflight import layout_of as layout_of  # re-exported: tests and recipes use them
from lightning_parallel.cli.preflight import world_size_of as world_size_of
from lightning_parallel.cli.report import fit_metrics as fit_metrics  # re-exported: tests use it
from lightning_parallel.cli.report import log_final_hparams, write_metrics
from lightning_parallel.cli.run_folder import discard_refused_folder, register_resolver
from lightning_parallel.cli.sweep_summary import SweepSummary, record_failure
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.runtime import log as _log  # noqa: F401 - its console handler, set before Hydra logs
from lightning_parallel.runtime import signals
from lightning_parallel.runtime.config_dir import CONFIG_DIR as _CONFIG_DIR

register_resolver()  # hydra.run.dir names each run's own folder (conf/config.yaml)
# Lightning 2.6.6's own pytree helper (lightning/pytorch/utilities/_pytree.py) builds torch's deprecated LeafSpec in
# every fit: one FutureWarning per rank that no user or recipe can act on (the fix is Lightning's). Filtered once here.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


class _NoCloudTips(logging.Filter):
    """Drops Lightning's "Tip: For seamless cloud uploads/logging ... litmodels/litlogger" lines: suggestions to
    install packages the suite does not use, printed by every run (one per checkpoint callback or logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not ("Tip:" in message and ("litmodels" in message or "litlogger" in message))


for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(_NoCloudTips())

CONFIG_DIR = str(_CONFIG_DIR)  # Hydra wants a string


def _callbacks(cfg: DictConfig, logger: Any, at_fit_end: Any = None) -> list[Any]:
    """The configured callbacks, plus the suite's stop-on-signal, exact data resume and step-keyed seeds (always),
    step progress bar, and with a logger the per-step gradient norm, memory and pipeline bubble (``at_fit_end``: the
    final write)."""
    import lightning.pytorch as pl

    from lightning_parallel.callbacks.evaluation import EvaluationReport
    from lightning_parallel.callbacks.exact_resume import ExactDataResume
    from lightning_parallel.callbacks.graceful_stop import GracefulStop
    from lightning_parallel.callbacks.pipeline_bubble import PipelineBubble
    from lightning_parallel.callbacks.progress import StepProgressBar
    from lightning_parallel.callbacks.run_scalars import RunScalars
    from lightning_parallel.callbacks.step_seeds import StepSeeds

    callbacks = [instantiate_node(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not logger:
        # LearningRateMonitor refuses to run without a logger; `logger=none` should just work.
        callbacks = [c for c in callbacks if not isinstance(c, pl.callbacks.LearningRateMonitor)]
    for callback in callbacks:
        if isinstance(callback, EvaluationReport):
            callback.print_table = False  # its rows go into the one result table
    if not any(isinstance(c, ExactDataResume) for c in callbacks):  # a resume is exact with any callbacks config
        callbacks.append(ExactDataResume())
    if not any(isinstance(c, StepSeeds) for c in callbacks):  # and draws the same dropout masks
        callbacks.append(StepSeeds())
    callbacks.append(GracefulStop(str(cfg.paths.checkpoint_dir)))
    if logger:
        callbacks += [RunScalars(at_fit_end), PipelineBubble()]
    has_bar = any(isinstance(c, pl.callbacks.ProgressBar) for c in callbacks)
    if cfg.trainer.get("enable_progress_bar", True) and not has_bar:
        callbacks.append(StepProgressBar())
    return callbacks


def instantiate_node(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (imported late: the entry point starts faster)."""
    from hydra.utils import instantiate

    return instantiate(node, **kwargs)


def _fit(trainer: Any, model: Any, datamodule: Any, start: Optional[Path], trust_source: bool) -> None:
    """``trainer.fit`` from ``start`` (None: a fresh start), reading a single-file checkpoint as the suite allows."""
    from lightning_parallel.checkpoints.safe_loading import safe_globals

    # Lightning reads a single-file checkpoint with torch's weights_only=True, which refused the run's own file when its
    # hyper-parameters hold Hydra's containers (gpt_moe, the HF and DLRM recipes): the suite's allow-list admits them.
    # trust_source=true: the user vouches for ckpt_path's pickled objects (weights_only=False runs what they hold).
    with safe_globals():
        trainer.fit(model, datamodule=datamodule, ckpt_path=str(start) if start else None,
                    weights_only=False if trust_source else None)


def train(cfg: DictConfig, prepared: Optional[tuple[Any, ParallelLayout]] = None,
          start: Optional[Path] = None, notes: Optional[dict[str, str]] = None) -> dict[str, float]:
    """Build everything from ``cfg`` and fit; returns the final metrics (same on every rank).

    Rank 0 also writes ``<output_dir>/.hydra/effective.yaml`` before fitting and
    ``<output_dir>/metrics.json`` after (read by :class:`lightning_parallel.cli.sweep_summary.SweepSummary`).

    Args:
        cfg: the composed Hydra config (``conf/config.yaml`` plus overrides).
        prepared: :func:`preflight` of ``cfg`` when the caller already ran it.
        start: the checkpoint to resume from (None: a fresh start); see
            :func:`lightning_parallel.cli.run_start.start_checkpoint`.
        notes: extra rows for the start-up table.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_parallel.cli.report import result_rows, startup_table
    from lightning_parallel.cli.run_resume import describe_start
    from lightning_parallel.runtime.console import print_table

    pl.seed_everything(cfg.seed, workers=True)
    strategy, layout = prepared or preflight(cfg)
    effective = apply_scaling(cfg, layout)
    summary = run_summary(cfg, strategy, layout, effective)

    datamodule, model = instantiate_node(cfg.data), instantiate_node(cfg.model)
    logger = instantiate_node(cfg.logger) if cfg.get("logger") else False

    def at_fit_end(trainer: pl.Trainer) -> None:  # before Lightning closes the logger: the run keeps one event file
        if rank_zero_only.rank == 0:
            log_final_hparams(logger, summary, fit_metrics(trainer, datamodule))

    trainer: pl.Trainer = instantiate_node(
        cfg.trainer, strategy=strategy, logger=logger, callbacks=_callbacks(cfg, logger, at_fit_end)
    )
    if logger:
        logger.log_hyperparams({"layout": layout.describe(), **OmegaConf.to_container(cfg, resolve=True)})
    if rank_zero_only.rank == 0:
        save_effective_config(cfg, summary)
        rows = startup_table(cfg, strategy, layout, effective, logger, summary)
        print_table("lightning_parallel: run", rows + [("start", describe_start(start)), *(notes or {}).items()])

    _fit(trainer, model, datamodule, start, bool(cfg.get("trust_source")))
    metrics = fit_metrics(trainer, datamodule)
    if rank_zero_only.rank == 0:
        print_table("lightning_parallel: result", result_rows(trainer, metrics, cfg))
        write_metrics(Path(cfg.paths.output_dir), summary, metrics)
    return metrics



def _report_stop(cfg: DictConfig) -> None:
    """After a stop on SIGINT/SIGTERM: what was saved, how long it took, and how to continue (rank 0)."""
    import time

    from lightning_parallel.cli.run_resume import checkpoint_step

    shutdown = signals.current()
    if shutdown is None or os.environ.get("RANK", "0") != "0":
        return
    took = time.monotonic() - (shutdown.signal_time or time.monotonic())
    saved = (
        f"saved {shutdown.saved} (step {checkpoint_step(Path(shutdown.saved))})" if shutdown.saved else "nothing saved"
    )
    print(f"lp-train: stopped {took:.1f} s after the signal; {saved}. "
          f"Continue with: lp-train resume={cfg.paths.output_dir}",
          file=sys.stderr, flush=True)


def _train_then_leave_group(cfg: DictConfig, *args: Any) -> dict[str, float]:
    """:func:`train`, then leave the process group while every rank is still there to leave it together."""
    from lightning_parallel.runtime.process_group import leave_process_group

    try:
        metrics = train(cfg, *args)
    except BaseException:
        leave_process_group(together=False)
        raise
    leave_process_group(together=True)
    return metrics


def run(cfg: DictConfig) -> Optional[float]:
    """Run one job, starting the other local ranks first when this process is the only one."""
    from hydra.core.hydra_config import HydraConfig

    from lightning_parallel.cli.launch import local_ranks, restored_rank_environment
    from lightning_parallel.cli.replica_launch import supervise, supervises
    from lightning_parallel.cli.run_start import prepare_run

    if supervises(cfg):  # strategy.fault_tolerance on one node: start the replica groups, each its own lp-train
        supervise(cfg)
        if signals.stop_requested():  # the groups saved and left; so does the supervisor, with their exit code
            logging.shutdown()
            os._exit(signals.INTERRUPTED_EXIT_CODE)
        return None
    run_ = prepare_run(cfg)
    prepared = (run_.strategy, run_.layout)

    def forked_rank() -> int:  # a rank forked from this process (cli/forked_rank.py) runs the job prepared here
        try:
            _train_then_leave_group(cfg, prepared, run_.start, run_.notes)
        except Exception as error:  # noqa: BLE001 - as hydra_main: one line, left for the launcher to print
            _report_failure(error, cfg)
        return signals.INTERRUPTED_EXIT_CODE if signals.stop_requested() else 0

    with restored_rank_environment():
        if run_.processes:
            with local_ranks(cfg, Path(HydraConfig.get().runtime.output_dir), run_.processes, run_.identity,
                             rank_body=forked_rank):
                metrics = _train_then_leave_group(cfg, prepared, run_.start, run_.notes)
        else:
            metrics = _train_then_leave_group(cfg, prepared, run_.start, run_.notes)
    if signals.stop_requested():
        _report_stop(cfg)
        # Everything is saved: skip the interpreter's slow teardown, which a user waiting on Ctrl-C would sit through.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(signals.INTERRUPTED_EXIT_CODE)
    monitor = cfg.get("optimized_metric")
    return metrics.get(monitor) if monitor else None


def _multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _report_failure(error: BaseException, cfg: DictConfig) -> float:
    """One short line for an error (the traceback goes to the run's log file); in a multirun the job's row."""
    from lightning_parallel.cli.errors import RankError, error_line, is_peer_gone, rank_error_file
    from lightning_parallel.cli.run_start import log_traceback

    log = log_traceback(error)
    line = error_line(error)  # the root cause, not Hydra's "Error in call to target"; long lists shortened
    if _multirun():
        record_failure(Path(cfg.paths.output_dir), error)
        print(f"lp-train: job failed: {line} (full traceback: {log})", file=sys.stderr, flush=True)
        return float("nan")  # the sweep goes on; the summary gets a failure row
    if isinstance(error, RankError):  # another rank failed first; rank 0 only saw it leave (cli/launch.py)
        print(f"lp-train: error (rank {error.rank}): {error.line}", file=sys.stderr, flush=True)
        sys.exit(1)
    if isinstance(error, ConfigError):
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":  # refused before start: no folder left
            discard_refused_folder(Path(cfg.paths.output_dir))
        report_config_error(error)
    rank = os.environ.get("RANK", "0")
    if rank != "0" and "LP_PARENT_PID" in os.environ:
        # A rank this entry point started: the launcher prints its line once (cli/launch.py), not every rank.
        try:
            rank_error_file(Path(cfg.paths.output_dir), int(rank)).write_text(f"{line}\n  full traceback: {log}\n")
            sys.exit(1)
        except OSError:
            pass
    if rank != "0" and is_peer_gone(error):  # torchrun, SLURM: another rank failed first and says why
        sys.exit(1)
    where = "" if rank == "0" else f" (rank {rank})"
    print(f"lp-train: error{where}: {line}\n  full traceback: {log}", file=sys.stderr, flush=True)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exception(type(error), error, error.__traceback__)
    sys.exit(1)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> Optional[float]:
    """The Hydra task: one job (``lp-train`` is :func:`main`)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    try:
        return run(cfg)
    except Exception as error:  # noqa: BLE001 - every error ends as one line; its traceback is in the log file
        return _report_failure(error, cfg)


def _expand_resume(overrides: list[str]) -> None:
    """``resume=<folder>``: run with the folder's original overrides (those given now win)."""
    from lightning_parallel.cli.run_resume import resume_overrides

    given = [o for o in overrides if o.lstrip("+").startswith("resume=")]
    if not given:
        return
    folder = given[-1].split("=", 1)[1]
    try:
        expanded = resume_overrides(Path(folder), overrides)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    sys.argv = [sys.argv[0], *[a for a in sys.argv[1:] if a not in overrides], *expanded]


def _check_overrides() -> None:
    """Group options and keys of the command line against ``conf/`` (did-you-mean), before Hydra composes; not for
    a child rank or another config folder, whose configuration is not ``conf/``."""
    from lightning_parallel.cli.overrides_check import check_overrides

    args = sys.argv[1:]
    if any(a.startswith(("--config", "-c")) or a.lstrip("+").startswith("hydra.searchpath") for a in args):
        return
    try:
        check_overrides([a for a in args if "=" in a and not a.startswith("-")], CONFIG_DIR)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def main() -> None:
    """Console entry point (``lp-train``): checks of the command line, signals, the Hydra app, the sweep's exit code."""
    from lightning_parallel.cli.launch import check_rank_config

    check_rank_config()  # a child rank: its configuration file must be the one its launcher wrote
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # ours, not Hydra's stock page (--hydra-help keeps that)
        from lightning_parallel.cli.help_text import TRAIN, hydra_app_help

        print(hydra_app_help(**TRAIN, config_dir=CONFIG_DIR))
        return
    overrides = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    try:
        check_trainer_overrides(overrides)
        _expand_resume(overrides)
        _check_overrides()
    except ConfigError as error:
        print(f"lp-train: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    signals.install()
    SweepSummary.failed_jobs = 0
    hydra_main()
    if SweepSummary.failed_jobs:
        sys.exit(min(SweepSummary.failed_jobs, 125))  # the multirun's exit code: how many jobs failed


if __name__ == "__main__":
    main()
