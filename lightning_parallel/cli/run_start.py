"""What the entry point settles before training: the run folder claimed, the checkpoint to start from,
a validation schedule that ends with a validation, log lines in the run's log file.

Each function takes the composed config and answers with plain values; errors are
:class:`~lightning_parallel.cli.preflight.ConfigError` (one line and a remedy), raised before any rank starts.
"""

from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, open_dict

from lightning_parallel.cli.preflight import ConfigError
from lightning_parallel.cli.run_folder import claim, external_launch_error, job_label, run_id
from lightning_parallel.cli.run_resume import last_checkpoint, no_checkpoint_message
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.runtime.console import log_to_file


def _is_global_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def claim_run_folder(cfg: DictConfig, launched_externally: bool) -> str:
    """Check the run folder can be this run's and claim it (global rank 0); returns the run id.

    Args:
        cfg: the composed config (``paths.output_dir``, ``resume``).
        launched_externally: torchrun or SLURM started every rank.

    Raises:
        ConfigError: torchrun ranks without one folder, or a folder another run owns.
    """
    slurm = "SLURM_JOB_ID" in os.environ
    problem = external_launch_error(launched_externally, slurm)
    if problem:
        raise ConfigError(problem)
    identity = run_id()
    if not _is_global_rank_zero():
        return identity
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or slurm
    try:
        claim(Path(cfg.paths.output_dir), identity, bool(cfg.get("resume")) or restarted, job_label())
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return identity


def _runs_root(output_dir: Path) -> Path:
    """The folder runs are made in: ``outputs`` for ``outputs/<date>/<run>``, else the folder above."""
    return output_dir.parent.parent if output_dir.parent.parent.name == "outputs" else output_dir.parent


def start_checkpoint(cfg: DictConfig) -> Optional[Path]:
    """The checkpoint this run starts from (None: a fresh start), resolved once for every rank.

    ``resume=<folder>`` and ``ckpt_path=last`` take the folder's newest ``last*.ckpt``; a missing
    one is an error listing the runs that could be resumed (under torchrun's restarts a first
    attempt has none yet, which is a fresh start).

    Raises:
        ConfigError: nothing to resume from, or a ``ckpt_path`` that does not exist.
    """
    ckpt, resume = cfg.get("ckpt_path"), cfg.get("resume")
    checkpoint_dir = Path(cfg.paths.checkpoint_dir)
    if resume or ckpt == "last":
        found = last_checkpoint(checkpoint_dir)
        if found is None and ckpt == "last" and not resume and "TORCHELASTIC_RUN_ID" in os.environ:
            return None  # torchrun --max-restarts: the first attempt starts fresh, restarts resume
        if found is None:
            output_dir = Path(cfg.paths.output_dir)
            raise ConfigError(no_checkpoint_message(checkpoint_dir, _runs_root(output_dir), job_label()))
        return found
    if ckpt is None:
        return None
    path = Path(str(ckpt))
    if path.is_dir() and (path / ".hydra").is_dir():
        raise ConfigError(f"ckpt_path={ckpt} is a run folder: continue it with resume={ckpt}")
    if not path.exists():
        raise ConfigError(f"ckpt_path={ckpt} does not exist: give a checkpoint file or folder, "
                          "ckpt_path=last, or resume=<run folder>")
    return path


ONE_PROCESS = "strategy=hybrid strategy.pipeline_parallel_size=1 strategy.tensor_parallel_size=1 trainer.devices=1"


def check_start_readable(strategy: Any, start: Optional[Path]) -> None:
    """Refuse, before any rank starts, a sharded checkpoint folder under one of Lightning's own strategies.

    Lightning's single-device and DDP strategies read single files only; they failed after start-up with
    ``IsADirectoryError`` on a folder the suite's strategies wrote (seen: a data 2 x expert 2 run resumed with
    ``strategy=single``). The suite's strategies read every format at any layout, one process included.

    Args:
        strategy: the strategy the run builds (a registered name such as ``"auto"``, or an object).
        start: the checkpoint every rank loads (None: a fresh start).

    Raises:
        ConfigError: ``start`` is a folder and ``strategy`` is not one of the suite's.
    """
    if start is None or not start.is_dir() or type(strategy).__module__.startswith("lightning_parallel."):
        return
    from lightning_parallel.checkpoints.detect import describe_checkpoint

    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    raise ConfigError(
        f"{start} is a sharded checkpoint folder ({describe_checkpoint(start)[1]}), which Lightning's own strategy "
        f"({name}) cannot read. On one process, resume with the suite's strategy at size 1 ({ONE_PROCESS}; it "
        f"reads every checkpoint the suite writes, at any layout), or convert it first: lp-convert {start} "
        "model.ckpt --to lightning, then ckpt_path=model.ckpt.")


def validation_schedule(cfg: DictConfig) -> Optional[str]:
    """Make validation run at least once and, where it costs at most twice the validations, on the last step.

    With ``trainer.val_check_interval`` (in batches) above the run's batches the run would end
    without a validation loss: the interval becomes the run's length. When it does not divide the
    run's batches, the last steps go unvalidated: the interval becomes the largest divisor of the
    run's batches between half the interval and the interval (more validations, never fewer);
    without one (a prime number of batches) it stays.

    Args:
        cfg: the composed config (``trainer`` is changed in place).

    Returns:
        A note for the start-up table when the interval changed, else None.
    """
    trainer = cfg.trainer
    interval, max_steps = trainer.get("val_check_interval"), trainer.get("max_steps")
    if not isinstance(interval, int) or isinstance(interval, bool) or not max_steps or max_steps < 1:
        return None
    batches = int(max_steps) * int(trainer.get("accumulate_grad_batches") or 1)
    if batches % interval == 0:
        return None
    low = max(1, min((interval + 1) // 2, batches))
    divisors = [d for d in range(low, min(interval, batches) + 1) if batches % d == 0]
    if not divisors:
        return None
    chosen = max(divisors)
    with open_dict(cfg):
        trainer.val_check_interval = chosen
        trainer.check_val_every_n_epoch = None  # count batches across epochs
    why = "is longer than" if interval > batches else "does not divide"
    return (f"every {chosen} batches (trainer.val_check_interval={interval} {why} the run's "
            f"{batches} batches: validation runs at least once and on the last step)")


def route_logs_to_file() -> None:
    """Copy Lightning's log lines into the run's log file (``train.log``/``rank<k>.log``, Hydra's file handler).

    Note:
        Lightning gives its loggers their own console handler and stops propagation when it is
        imported before logging is configured, which ``import lightning_parallel`` does; the
        run's log file then stays empty. The console keeps Lightning's own lines as they were.
    """
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel"):
        logger = logging.getLogger(name)
        if logger.propagate:
            continue  # the root logger's handlers (the file included) already get its lines
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)



def log_traceback(error: BaseException) -> Optional[str]:
    """Write ``error``'s full traceback to the run's log file; returns the file's path (None without one)."""
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if files:
        log_to_file("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    return files[0] if files else None


def check_start_model(cfg: DictConfig, start: Optional[Path]) -> None:
    """Refuse a start checkpoint that is unreadable or of another model (cli/checkpoint_check.py).

    Args:
        cfg: the composed config.
        start: the checkpoint every rank would load (None: a fresh start).

    Raises:
        ConfigError: naming the setting and the fix.
    """
    if start is None:
        return
    from lightning_parallel.cli.checkpoint_check import check_resume_checkpoint
    from lightning_parallel.cli.preflight import meta_model

    try:
        check_resume_checkpoint(cfg, start, meta_model(cfg))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


@dataclass(frozen=True)
class PreparedRun:
    """Everything settled before any rank starts (:func:`prepare_run`).

    Attributes:
        processes: local ranks this process starts (0 when a launcher already started them).
        strategy: the strategy object (or Lightning's name) that preflight built.
        layout: its resolved layout.
        start: the checkpoint every rank loads (None: a fresh start).
        notes: extra start-up table rows (the planner's choice, the validation schedule).
        identity: the run folder's owner identity, handed to the local ranks.
    """

    processes: int
    strategy: Any
    layout: ParallelLayout
    start: Optional[Path]
    notes: dict[str, str]
    identity: str


def prepare_run(cfg: DictConfig) -> PreparedRun:
    """Everything settled before any rank starts: processes, checks, start checkpoint, run folder, validation."""
    from lightning_parallel.cli.launch import launched_externally, processes_to_launch
    from lightning_parallel.cli.planned import plan_if_asked
    from lightning_parallel.cli.preflight import preflight

    route_logs_to_file()
    try:
        nprocs = processes_to_launch(cfg.trainer.devices, int(cfg.trainer.num_nodes))
        planned = plan_if_asked(cfg)  # strategy=planned: the planner's layout replaces cfg.strategy
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    strategy, layout = preflight(cfg)  # before any other rank starts: a bad config is reported once
    start = start_checkpoint(cfg)
    check_start_readable(strategy, start)
    check_start_model(cfg, start)
    identity = claim_run_folder(cfg, bool(launched_externally()))
    note = validation_schedule(cfg)
    with open_dict(cfg):
        cfg.ckpt_path = str(start) if start else None  # every rank loads this one checkpoint
    notes = {**planned, **({"validation": note} if note else {})}
    return PreparedRun(nprocs, strategy, layout, start, notes, identity)
