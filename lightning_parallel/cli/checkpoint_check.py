"""The checkpoint a run resumes from, read before any process starts: readable, and of this model.

Before, a truncated ``ckpt_path`` showed as "resumed from step ?" and failed after the process group started with
torch's zip error; a checkpoint of another model failed in the optimizer ("Param-group mismatch ... pass
load_optimizer_state=False"), whose advice led into a second error. Here the file's kind is read from its bytes
(:func:`~lightning_parallel.checkpoints.detect.describe_checkpoint`, ``lp-convert``'s "truncated or damaged" check)
and its tensor names and shapes -- from DCP's metadata or the memory-mapped file, never the values -- are compared
with the model built on the meta device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

_LISTED = 3  # names shown per kind of difference


def checkpoint_shapes(path: Path, writer: str) -> Optional[dict[str, tuple[int, ...]]]:
    """``{module name: shape}`` of the weights a checkpoint holds (None: the kind is not read here).

    Args:
        path: a checkpoint file or DCP folder.
        writer: its kind (:func:`~lightning_parallel.checkpoints.detect.describe_checkpoint`).

    Raises:
        ValueError: the file is truncated or damaged (``CheckpointRefused``).
    """
    if writer in ("suite-dcp", "lightning-dcp"):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from lightning_parallel.checkpoints.dcp import resolve_checkpoint
        from lightning_parallel.checkpoints.safe_loading import SafeFileSystemReader

        items = SafeFileSystemReader(resolve_checkpoint(path)).read_metadata().state_dict_metadata.items()
        tensors = {key: tuple(item.size) for key, item in items if isinstance(item, TensorStorageMetadata)}
        for prefix in ("state_dict.", "model."):
            found = {key[len(prefix):]: shape for key, shape in tensors.items() if key.startswith(prefix)}
            if found:
                return found
        return None
    if writer == "lightning-single-file":
        from lightning_parallel.checkpoints.lightning.reader import load_single_file

        try:
            state = load_single_file(path)
        except ValueError as exc:
            if "truncated or damaged" in str(exc):
                raise
            return None  # objects beyond the allow-list: Lightning's own load says so, with its remedy
        weights = state.get("state_dict") if isinstance(state, dict) else None
        return {k: tuple(v.shape) for k, v in weights.items() if hasattr(v, "shape")} if weights else None
    return None  # DeepSpeed folders: their shards hold flat partitions, checked by the strategy that reads them


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_LISTED]) + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def model_difference(stored: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]]) -> Optional[str]:
    """What sets a checkpoint's weights apart from a model's (None when every model tensor is there in its shape).

    Args:
        stored: ``{name: shape}`` of the checkpoint.
        model: ``{name: shape}`` of the model's ``state_dict`` (on the meta device).
    """
    shapes = [n for n in model if n in stored and stored[n] != model[n]]
    missing = [n for n in model if n not in stored]
    if not shapes and not missing:
        return None
    parts = []
    if shapes:
        first, others = shapes[0], f"; {_listed(shapes[1:])}" if shapes[1:] else ""
        parts.append(f"{len(shapes)} of {len(model)} tensors have another shape ({first}: {list(stored[first])} in "
                     f"the checkpoint, {list(model[first])} in this model{others})")
    if missing:
        parts.append(f"{len(missing)} of this model's tensors are not in it ({_listed(missing)})")
    unexpected = [n for n in stored if n not in model]
    if unexpected:
        parts.append(f"it holds {len(unexpected)} this model lacks ({_listed(unexpected)})")
    return "; ".join(parts)


def _setting(cfg: DictConfig, start: Path) -> str:
    """How the user named the checkpoint: ``resume=<folder>`` or ``ckpt_path=<path>``."""
    if cfg.get("resume"):
        return f"resume={cfg.resume}"
    return f"ckpt_path={cfg.get('ckpt_path') or start}"


def _model_overrides(start: Path) -> str:
    """The ``model=``/``model.*`` overrides of the run that wrote ``start`` (empty when not found)."""
    import yaml

    for folder in (start.parent.parent, start.parent):
        record = folder / ".hydra" / "overrides.yaml"
        if record.is_file():
            overrides = yaml.safe_load(record.read_text()) or []
            chosen = [o for o in overrides if str(o).lstrip("+~").startswith(("model=", "model.", "experiment="))]
            return " ".join(chosen) or "the default model"
    return ""


def check_resume_checkpoint(cfg: DictConfig, start: Optional[Path], model: Any) -> None:
    """Refuse a start checkpoint that is damaged, not a checkpoint, or of another model, before any process starts.

    Args:
        cfg: the composed config (``ckpt_path``/``resume`` name the checkpoint in messages).
        start: the checkpoint every rank would load (None: a fresh start).
        model: the LightningModule built on the meta device (None: it needs the Trainer; names are not compared).

    Raises:
        ValueError: naming the setting, what the checkpoint is, and the fix.
    """
    if start is None:
        return
    from lightning_parallel.checkpoints.detect import describe_checkpoint

    setting = _setting(cfg, start)
    writer, description = describe_checkpoint(start)
    if writer == "unknown":
        raise ValueError(f"{setting}: {start} is not a checkpoint a run can resume from; it looks like {description}.")
    try:
        stored = checkpoint_shapes(start, writer)
    except ValueError as exc:
        raise ValueError(f"{setting}: {exc}") from None
    if stored is None or model is None:
        return
    difference = model_difference(stored, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    if difference is None:
        return
    written_by = _model_overrides(start)
    by = f" (the run that wrote it chose: {written_by})" if written_by else ""
    raise ValueError(
        f"{setting} holds another model than this run's {type(model).__name__}: {difference}. Resume it with the model "
        f"settings it was trained with{by}, or leave {setting.split('=')[0]} out to start this model afresh.")
