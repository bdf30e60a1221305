"""What ``ckpt_path=last`` and ``resume=<run folder>`` continue from, said before anything trains.

``ckpt_path=last`` without a checkpoint is an error that lists the recent runs of the same
experiment (or strategy) and the command that resumes each; ``resume=<folder>`` continues in that
folder (its checkpoints, its TensorBoard run) from its newest ``last*.ckpt``, with the overrides
the run was started with (:func:`resume_overrides`). Both are resolved here to one concrete path,
so every rank loads the same checkpoint and the start-up table can say which step it is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from lightning_parallel.cli.run_folder import LP_DIR, RUN_FILE, read_owner

# Overrides of the original run that a resume must not repeat: the resume names its own folder and checkpoint.
_NOT_REPEATED = ("hydra.run.dir", "hydra.sweep.dir", "ckpt_path", "resume", "+resume", "++resume")


def last_checkpoint(checkpoint_dir: Path) -> Optional[Path]:
    """The ``last*.ckpt`` (file or sharded folder) in ``checkpoint_dir`` furthest in training, or None.

    Furthest by the global step each records, then by time written: a file's time alone let a ``last.ckpt``
    written after a stop win over the stop's ``last-stop.ckpt`` (see :mod:`lightning_parallel.callbacks.graceful_stop`
    for why both now hold the same position).
    """
    if not checkpoint_dir.is_dir():
        return None
    found = [p for p in checkpoint_dir.glob("last*.ckpt") if not p.name.startswith(".")]
    if not found:
        return None
    steps = {p: checkpoint_step(p) for p in found}
    return max(found, key=lambda p: (-1 if steps[p] is None else steps[p], p.stat().st_mtime))


def checkpoint_step(path: Path) -> Optional[int]:
    """The global step a checkpoint was written at (None when it cannot be read cheaply).

    Args:
        path: a Lightning ``.ckpt`` file or a sharded checkpoint folder (``meta.pt`` inside).
    """
    import torch

    from lightning_parallel.checkpoints.safe_loading import safe_globals

    try:
        source = _step_file(path)
        with safe_globals():  # Hydra's containers in the hyper-parameters, nothing else
            state = torch.load(source, map_location="cpu", mmap=source.name != "meta.pt", weights_only=True)
        return int(state["global_step"])
    except Exception:  # noqa: BLE001 - a checkpoint with more than plain values: fall back to its name
        match = re.search(r"step[=_-]?(\d+)", path.name)
        return int(match.group(1)) if match else None


def _step_file(path: Path) -> Path:
    """The file of a checkpoint that records its global step: the file itself, a sharded folder's ``meta.pt``, or a
    DeepSpeed folder's model-states file (Lightning's entries ride in DeepSpeed's client state)."""
    if not path.is_dir() or (path / "meta.pt").is_file():
        return path / "meta.pt" if path.is_dir() else path
    from lightning_parallel.checkpoints.deepspeed.folder import first_model_states, resolve_folder

    top, tag = resolve_folder(path, None)
    return first_model_states(top / tag)


def recent_runs(root: Path, label: dict[str, Any], limit: int = 5,
                with_checkpoint: bool = False) -> list[tuple[Path, Optional[Path]]]:
    """Run folders under ``root/<date>/`` of the same experiment (or strategy), newest first.

    Args:
        root: the folder runs are made in (``outputs``).
        label: ``experiment`` and ``strategy`` of the run that asks.
        limit: how many to return.
        with_checkpoint: only runs with a ``last*.ckpt``, chosen before the limit (the newest runs were often
            refused or stopped early: filtering the 5 newest said "no run has a checkpoint" while one had).
    """
    key = "experiment" if label.get("experiment") else "strategy"
    runs = []
    for record in root.glob(f"*/*/{LP_DIR}/{RUN_FILE}"):
        folder = record.parent.parent
        if read_owner(folder).get(key) == label.get(key):
            runs.append((record.stat().st_mtime, folder))
    runs.sort(key=lambda item: item[0], reverse=True)
    found = []
    for _, folder in runs:
        ckpt = last_checkpoint(folder / "checkpoints")
        if ckpt is not None or not with_checkpoint:
            found.append((folder, ckpt))
        if len(found) == limit:
            break
    return found


def no_checkpoint_message(checkpoint_dir: Path, root: Path, label: dict[str, Any]) -> str:
    """The error for ``ckpt_path=last`` in a folder without a checkpoint, with the runs that could resume.

    Args:
        checkpoint_dir: where the run looked.
        root: the folder runs are made in.
        label: ``experiment`` and ``strategy`` of the run.
    """
    name = label.get("experiment") or label.get("strategy")
    lines = [f"ckpt_path=last, but {checkpoint_dir} holds no last*.ckpt (a new run folder has none): "
             f"continue an earlier run with resume=<its folder>, or drop ckpt_path for a fresh start."]
    runs = recent_runs(root, label, with_checkpoint=True)
    if runs:
        lines.append(f"Recent runs of {name} with a checkpoint:")
        for folder, ckpt in runs:
            step = checkpoint_step(ckpt)
            lines.append(f"  lp-train resume={folder}    # step {step if step is not None else '?'}")
    else:
        lines.append(f"No run of {name} under {root} has a checkpoint yet.")
    return "\n".join(lines)


def resume_overrides(folder: Path, given: list[str]) -> list[str]:
    """The overrides ``resume=<folder>`` runs with: the original run's, then those given now (which win; a group
    chosen anew, ``strategy=tensor``, drops the original's settings of that group, ``strategy.*``).

    Args:
        folder: the run folder to continue in (its ``.hydra/overrides.yaml`` holds the original overrides).
        given: the command-line overrides of this invocation.

    Raises:
        ValueError: ``folder`` is not a run folder.
    """
    import yaml

    if not (folder / ".hydra" / "overrides.yaml").is_file():
        raise ValueError(f"resume={folder}: not a run folder (no .hydra/overrides.yaml there): give a folder "
                         f"lp-train made, e.g. outputs/<date>/<run>")
    original = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text()) or []
    keys = {_key(o) for o in given}
    # A new group choice (strategy=single) starts that group afresh: the run's strategy.* settings belonged to its
    # old choice and may not exist in the new one (Hydra refused `resume=... strategy=single` after a hybrid run).
    groups = tuple(f"{key}." for key in keys if "." not in key)
    kept = [o for o in original
            if _key(o) not in keys and _key(o) not in _NOT_REPEATED and not _key(o).startswith(groups)]
    return [*kept, *given]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def describe_start(ckpt: Optional[Path]) -> str:
    """``resumed from step N of <path>`` or ``fresh start`` (the start-up table's row)."""
    if ckpt is None:
        return "fresh start"
    step = checkpoint_step(ckpt)
    return f"resumed from step {step if step is not None else '?'} of {ckpt}"


def record_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict (empty when missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
