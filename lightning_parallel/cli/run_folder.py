"""Run folders that cannot collide, the per-run file child ranks read, and what ``resume`` finds.

A run's folder is ``outputs/<date>/<HH-MM-SS.mmm>_<experiment or strategy>_<id>``: the id is six
random hex digits drawn once per process, so two runs started in the same millisecond still get
two folders. The entry point claims the folder by creating ``.lp/run.json`` with ``O_EXCL`` (an
atomic create): a second run pointed at a folder another run owns is refused unless it resumes
there (``resume=<folder>``).

Child ranks get their configuration from ``.lp/<run id>/config.yaml`` and check its run id and
SHA-256 (passed in their environment) before using it, so a rank can never read another run's
configuration even when two runs share a folder.

Note:
    Under SLURM (``srun``, one Hydra app per task) every task must compute the same folder
    without talking to the others, so the id there is the SLURM job id (stable across requeues,
    which then resume in the same folder). Under ``torchrun`` there is no such shared value:
    the entry point asks for ``hydra.run.dir`` instead (see :func:`external_launch_error`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

RUN_FILE = "run.json"
LP_DIR = ".lp"
RESOLVER = "lp_run_folder"
ENV_RUN_ID = "LP_RUN_ID"
ENV_CONFIG_SHA = "LP_CONFIG_SHA256"

_process_run: dict[str, str] = {}  # one id and start time per process: the resolver may be read several times


def run_id() -> str:
    """This process's run id (six hex digits, or ``slurm<job id>`` under SLURM; drawn once per process)."""
    if "id" not in _process_run:
        job = os.environ.get("SLURM_JOB_ID")
        _process_run["id"] = f"slurm{job}" if job else (os.environ.get(ENV_RUN_ID) or secrets.token_hex(3))
        _process_run["started"] = datetime.now().strftime("%Y-%m-%d/%H-%M-%S.%f")[:-3]
    return _process_run["id"]


def folder_was_generated() -> bool:
    """True when this process named its run folder itself (the resolver ran), rather than being given one."""
    return bool(_process_run.get("generated"))


def _label(name: Any) -> str:
    """A name safe inside a folder name (``nlp_gpt``, ``pipeline``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", str(name)).strip("-") or "run"


def run_folder(root: str, resume: Optional[str], experiment: Optional[str], strategy: Optional[str]) -> str:
    """Hydra resolver ``${lp_run_folder:outputs,${resume},...}``: the folder of this run.

    Args:
        root: the folder under which runs are made (``outputs``).
        resume: a run folder to continue in (returned as it is), or None for a new folder.
        experiment: the experiment chosen (its name labels the folder), or None.
        strategy: the strategy chosen (the label when no experiment is chosen).
    """
    if resume not in (None, "", "None", "null"):
        return str(resume)
    identity = run_id()
    _process_run["generated"] = "1"
    label = _label(experiment if experiment not in (None, "None", "null") else strategy)
    folder = f"{root}/{identity}_{label}" if identity.startswith("slurm") else \
        f"{root}/{_process_run['started']}_{label}_{identity}"
    _process_run["folder"] = str(Path(folder).resolve())
    return folder


def hydra_subdir(resume: Optional[str]) -> str:
    """Hydra resolver ``${lp_hydra_subdir:${resume}}``: where Hydra saves this run's ``.hydra`` files.

    ``.hydra`` in the run folder, except when the folder belongs to another run and this one does
    not resume there: Hydra writes its files before the entry point can refuse the folder, so they
    go to a temporary folder instead and the other run's ``.hydra`` stays as it was.

    Args:
        resume: the ``resume`` setting (a folder means the run continues there on purpose).
    """
    from hydra.core.hydra_config import HydraConfig

    if resume not in (None, "", "None", "null") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return ".hydra"
    try:
        output_dir = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not yet known (composing): the default
        return ".hydra"
    owner = read_owner(output_dir).get("run_id")
    if owner is None or owner == run_id():
        return ".hydra"
    return str(Path(tempfile.gettempdir()) / f"lp-refused-{run_id()}" / ".hydra")  # absolute: outside the folder


def register_resolver() -> None:
    """Register :func:`run_folder` and :func:`hydra_subdir` with OmegaConf (idempotent; before Hydra composes)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_folder)
    if not OmegaConf.has_resolver("lp_hydra_subdir"):
        OmegaConf.register_new_resolver("lp_hydra_subdir", hydra_subdir)


def job_label() -> dict[str, Any]:
    """``experiment``, ``strategy`` and the overrides of this Hydra job (empty outside a Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.get()
    return {
        "experiment": hydra_cfg.runtime.choices.get("experiment"),
        "strategy": hydra_cfg.runtime.choices.get("strategy"),
        "overrides": list(hydra_cfg.overrides.task),
    }


def external_launch_error(launched_externally: bool, slurm: bool) -> Optional[str]:
    """The error for a torchrun job whose ranks would each name their own folder (None when fine).

    Args:
        launched_externally: torchrun (or another launcher) started every rank.
        slurm: SLURM started them (the job id names one folder for all).
    """
    if launched_externally and not slurm and folder_was_generated():
        return ("the ranks of a torchrun job would each make their own run folder: give them one with "
                "hydra.run.dir=outputs/<name> (e.g. hydra.run.dir=outputs/my_run)")
    return None


def claim(output_dir: Path, identity: str, resume: bool, details: dict[str, Any]) -> dict[str, Any]:
    """Make ``output_dir`` this run's, atomically; returns the owner record (``.lp/run.json``).

    Args:
        output_dir: the run folder (Hydra created it).
        identity: this run's id.
        resume: True when the run continues in a folder on purpose (``resume=``).
        details: what to record (experiment, strategy, overrides, command).

    Raises:
        ValueError: the folder belongs to another run and this one does not resume there.
    """
    lp_dir = output_dir / LP_DIR
    lp_dir.mkdir(parents=True, exist_ok=True)
    record = {"run_id": identity, "pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), **details}
    try:
        fd = os.open(lp_dir / RUN_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        owner = read_owner(output_dir)
        if resume or owner.get("run_id") == identity:
            (lp_dir / f"resume-{identity}.json").write_text(json.dumps(record, indent=2))
            return owner
        raise ValueError(
            f"{output_dir} already holds run {owner.get('run_id', '?')} (started {owner.get('started', '?')}): "
            f"leave hydra.run.dir out for a new folder, or continue that run with resume={output_dir}"
        ) from None
    if _holds_other_run(output_dir) and not resume:
        os.close(fd)
        os.unlink(lp_dir / RUN_FILE)
        raise ValueError(f"{output_dir} already holds checkpoints or results of another run: leave hydra.run.dir out "
                         f"for a new folder, or continue in it with resume={output_dir}")
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(record, indent=2))
    return record


def discard_refused_folder(output_dir: Path) -> bool:
    """Remove the folder of a run refused before it started (and its date folder when that is left empty), so
    that nothing reads it as a run (``ckpt_path=last``, the list of recent runs); returns whether it was removed.

    Only a folder this process named itself (:func:`folder_was_generated`) and that holds nothing a run wrote
    (no checkpoints, no ``metrics.json``) is removed: a folder given with ``hydra.run.dir`` or ``resume`` stays.

    Args:
        output_dir: the run folder Hydra made for the refused run.
    """
    import shutil

    named_here = folder_was_generated() and _process_run.get("folder") == str(output_dir.resolve())
    owner = read_owner(output_dir).get("run_id")
    if not named_here or not output_dir.is_dir() or _holds_other_run(output_dir) or owner not in (None, run_id()):
        return False
    shutil.rmtree(output_dir, ignore_errors=True)
    try:
        output_dir.parent.rmdir()  # the date folder, when this was its only run
    except OSError:
        pass
    return not output_dir.exists()


def _holds_other_run(output_dir: Path) -> bool:
    checkpoints = output_dir / "checkpoints"
    return (output_dir / "metrics.json").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def read_owner(output_dir: Path) -> dict[str, Any]:
    """The ``.lp/run.json`` record of a run folder (empty when it has none or it is unreadable)."""
    try:
        return json.loads((output_dir / LP_DIR / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_rank_config(output_dir: Path, identity: str, config_yaml: str) -> tuple[Path, str]:
    """Write the configuration child ranks read: ``.lp/<run id>/config.yaml``; returns its folder and SHA-256.

    Args:
        output_dir: the run folder.
        identity: this run's id (the file's folder and its first line carry it).
        config_yaml: the resolved configuration as YAML.
    """
    folder = output_dir / LP_DIR / identity
    folder.mkdir(parents=True, exist_ok=True)
    text = f"# lightning_parallel run {identity}\n{config_yaml}"
    partial = folder / f".config.yaml.{os.getpid()}"
    partial.write_text(text)
    partial.replace(folder / "config.yaml")  # atomic: a rank never reads half a file
    return folder, hashlib.sha256(text.encode()).hexdigest()


def verify_rank_config(config_dir: Path, identity: str, sha256: str) -> None:
    """Check that ``config_dir/config.yaml`` is the file this rank's launcher wrote for run ``identity``.

    Raises:
        RuntimeError: the file is missing, from another run, or changed since the launcher wrote it.
    """
    path = config_dir / "config.yaml"
    try:
        text = path.read_text()
    except OSError as error:
        raise RuntimeError(
            f"rank configuration {path} is unreadable ({error}); the launcher wrote it for run {identity}"
        ) from None
    first = text.split("\n", 1)[0]
    if first != f"# lightning_parallel run {identity}" or hashlib.sha256(text.encode()).hexdigest() != sha256:
        raise RuntimeError(
            f"rank configuration {path} is not the one written for run {identity} ({first!r}): refusing to start"
        )
