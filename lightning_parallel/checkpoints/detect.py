"""Which program wrote a checkpoint, and Lightning's checkpoints read into the suite's keys.

:func:`identify_writer` names the writer from the files alone, never unpickling anything:

- ``"suite-dcp"``: a DCP folder (``.metadata`` + ``meta.pt``) with the suite's keys -- written by
  :class:`~lightning_parallel.strategies.HybridParallelStrategy` and its presets, by
  ``lp-convert ... --to dcp``, or by Lightning's ``ModelParallelStrategy`` without optimizer.
- ``"lightning-dcp"``: a DCP folder by Lightning's ``ModelParallelStrategy`` (param groups nested
  as ``optimizer_0.param_groups.<i>.<setting>``) or ``FSDPStrategy(state_dict_type="sharded")``
  (weights under ``model``).
- ``"lightning-single-file"``: one ``torch.save`` archive holding Lightning's entries
  (``pytorch-lightning_version``): single-device, DDP, FSDP full state, DeepSpeed
  ``convert_zero_checkpoint_to_fp32_state_dict`` output.
- ``"deepspeed"``: a DeepSpeed ZeRO 0-3 folder (``latest``, ``*_model_states.pt``), from
  Lightning's ``DeepSpeedStrategy`` or the suite's DeepSpeed strategy.
- ``"unknown"``: anything else; :func:`unreadable_checkpoint_error` says what it looks like and
  what makes it loadable.

:func:`read_lightning_checkpoint` reads a Lightning single file or DCP folder into one full,
unsharded checkpoint dict on this process (for converters; the strategies reshard without it).
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_parallel.checkpoints.dcp import METADATA_FILE, resolve_checkpoint, single_process
from lightning_parallel.checkpoints.deepspeed.folder import is_deepspeed_folder
from lightning_parallel.checkpoints.lightning.reader import (
    MODEL_KEYS,
    NESTED_GROUP_KEY,
    ORDER_KEY,
    flatten_nested_groups,
    load_single_file,
    nested_param_groups,
    optimizer_group_names,
    single_file_entries,
)
from lightning_parallel.checkpoints.safe_loading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_plain,
    plain_containers,
    refusals_unwrapped,
)

PathLike = Union[str, os.PathLike]
WRITERS = ("suite-dcp", "lightning-single-file", "lightning-dcp", "deepspeed", "unknown")
LIGHTNING_MARKER = "pytorch-lightning_version"
_SCAN_BYTES = 1 << 20  # Lightning's entries come first in data.pkl; tensors are stored outside it


def _pickle_strings(data: bytes) -> set[str]:
    """The string constants of a pickle, read opcode by opcode (nothing is executed or imported)."""
    strings = set()
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if isinstance(arg, str) and "UNICODE" in opcode.name:
                strings.add(arg)
    except Exception:  # noqa: BLE001 - a cut-off scan still tells what it saw
        pass
    return strings


def _describe_file(path: Path) -> tuple[str, str]:
    head = path.open("rb").read(16)
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                pickled = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
                data = archive.open(pickled).read(_SCAN_BYTES) if pickled else b""
        except (zipfile.BadZipFile, OSError, EOFError):
            return "unknown", (
                "a torch.save archive that is truncated or damaged (no readable zip directory): copy or save it again"
            )
        if LIGHTNING_MARKER in _pickle_strings(data):
            return "lightning-single-file", "a single-file Lightning checkpoint"
        return "unknown", ("a torch.save file without Lightning's entries (a plain state_dict?): it holds no training "
                           "progress. Load the weights in the LightningModule "
                           "(module.load_state_dict(torch.load(path))) and call fit without ckpt_path")
    if head[:1] == b"\x80":
        return "unknown", ("a torch.save file in the legacy (pre-1.6) format: re-save it with a current torch "
                           "(torch.save(torch.load(path, weights_only=False), new_path)) if you trust it")
    if len(head) > 8 and head[8:9] == b"{":
        return "unknown", ("a safetensors file (model weights only, e.g. Hugging Face): load it in the LightningModule "
                           "(safetensors.torch.load_file) and call fit without ckpt_path")
    return "unknown", "a file that is neither a torch.save archive nor a safetensors file"


def _describe_folder(path: Path) -> tuple[str, str]:
    if (path / ".metadata").is_file():
        if not (path / METADATA_FILE).is_file():
            return "unknown", (f"a DCP folder without Lightning's {METADATA_FILE} "
                               "(written by torch.distributed.checkpoint directly, or a save that did not finish): "
                               "it holds no training progress")
        keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata
        nested = any(NESTED_GROUP_KEY.match(k) and k.endswith(".params") for k in keys)
        if nested or (any(k.startswith("model.") for k in keys) and not any(k.startswith("state_dict.") for k in keys)):
            return "lightning-dcp", "a Lightning DCP folder (ModelParallelStrategy or FSDPStrategy sharded)"
        return "suite-dcp", "a lightning_parallel DCP folder"
    if is_deepspeed_folder(path):
        return "deepspeed", "a DeepSpeed ZeRO checkpoint folder"
    if (path / "config.json").is_file() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin"))):
        return "unknown", ("a Hugging Face model folder (weights only): load it with from_pretrained inside the "
                           "LightningModule and call fit without ckpt_path")
    return "unknown", ("a folder that is neither a DCP checkpoint (.metadata, meta.pt) nor a DeepSpeed one (latest, "
                       "*_model_states.pt): pass the folder or file trainer.save_checkpoint wrote")


def describe_checkpoint(path: PathLike) -> tuple[str, str]:
    """``(writer, description)`` of ``path``: one of :data:`WRITERS` and what it looks like.

    Args:
        path: a checkpoint file or folder (a crash-interrupted folder resolves to its previous copy).
    """
    path = resolve_checkpoint(Path(path))
    if path.is_dir():
        return _describe_folder(path)
    if path.is_file():
        return _describe_file(path)
    return "unknown", "a path that does not exist: check ckpt_path (ModelCheckpoint names files by its filename=)"


def identify_writer(path: PathLike) -> str:
    """Which writer ``path`` comes from: one of :data:`WRITERS` (see the module docstring); reads no pickle.

    Args:
        path: a checkpoint file or folder.
    """
    return describe_checkpoint(path)[0]


def unreadable_checkpoint_error(path: PathLike, reader: str = "lightning_parallel") -> ValueError:
    """A ``ValueError`` saying what ``path`` looks like and what makes it loadable.

    Args:
        path: the checkpoint that cannot be read.
        reader: who cannot read it, for the message (a strategy's name).
    """
    writer, description = describe_checkpoint(path)
    return ValueError(f"{reader} cannot resume from {str(path)!r}: it looks like {description} ({writer}).")


def _read_dcp_folder(
    path: Path, optimizer_state: bool = True, weights_only: Optional[bool] = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every entry of a DCP folder in full, by DCP key (one process; the optimizer's only if asked), and ``meta.pt``."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    entries: dict[str, Any] = {
        key: (
            torch.empty(tuple(item.size), dtype=item.properties.dtype)
            if isinstance(item, TensorStorageMetadata)
            else None
        )
        for key, item in stored.items()
        if optimizer_state or not key.startswith("optimizer_")
    }
    with single_process():
        with refusals_unwrapped():
            load(entries, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return entries, load_plain(path / METADATA_FILE, weights_only=weights_only is not False)


def _dcp_as_checkpoint(path: Path, optimizer_state: bool, weights_only: Optional[bool]) -> dict[str, Any]:
    entries, checkpoint = _read_dcp_folder(path, optimizer_state, weights_only)
    model_key = next((k for k in MODEL_KEYS if any(e.startswith(f"{k}.") for e in entries)), MODEL_KEYS[0])
    checkpoint["state_dict"] = {k[len(model_key) + 1 :]: v for k, v in entries.items() if k.startswith(f"{model_key}.")}
    optimizers = sorted({k.split(".", 1)[0] for k in entries if k.startswith("optimizer_")}, key=lambda k: int(k[10:]))
    checkpoint["optimizer_states"], order = [], []
    for key in optimizers:
        flat = {
            k[len(key) + 1 :]: v
            for k, v in entries.items()
            if k.startswith(f"{key}.") and not NESTED_GROUP_KEY.match(k)
        }
        groups = nested_param_groups(entries, key)
        checkpoint["optimizer_states"].append({**flat, **(flatten_nested_groups(groups) if groups else {})})
        order.append([list(group["params"]) for group in groups or ()])
    if optimizers and all(order):  # Lightning's nested groups name their parameters in order
        _record_order(checkpoint, order)
    return checkpoint


def _record_order(checkpoint: dict[str, Any], order: list[list[list[str]]]) -> None:
    """Keep the param groups' names where the suite records them, so a DCP folder written from this converts on."""
    checkpoint["lightning_parallel"] = {**(checkpoint.get("lightning_parallel") or {}), ORDER_KEY: order}


def _single_file_as_checkpoint(
    path: Path, group_names: Optional[Sequence[Sequence[Sequence[str]]]], weights_only: Optional[bool],
    optimizer_state: bool,
) -> dict[str, Any]:
    checkpoint = load_single_file(path, weights_only)
    if not optimizer_state:
        checkpoint.pop("optimizer_states", None)
        return checkpoint
    order = optimizer_group_names(checkpoint, group_names)
    if order:
        _record_order(checkpoint, order)
    return single_file_entries(checkpoint, order)


def read_lightning_checkpoint(
    path: PathLike,
    group_names: Optional[Sequence[Sequence[Sequence[str]]]] = None,
    weights_only: Optional[bool] = None,
    optimizer_state: bool = True,
) -> dict[str, Any]:
    """A Lightning checkpoint as one full (unsharded) Lightning checkpoint dict on this process.

    Args:
        path: a single-file Lightning checkpoint, or a Lightning (or suite) DCP folder.
        group_names: single files only: per optimizer, the parameter names of each param group
            in the order the optimizer was built. Default: inferred from the weights' order and
            the state's shapes (refused when more than one assignment fits).
        weights_only: ``False`` unpickles any object in a single file or a DCP folder's ``meta.pt`` (trusted
            files only); a DCP folder's ``.metadata`` and entries always go through the allow-list.
        optimizer_state: ``False`` reads no optimizer state (nothing to match: weights-only targets).

    Returns:
        ``"state_dict"``: full tensors under the LightningModule's parameter names (memory-mapped
        for a single file); ``"optimizer_states"``: per optimizer, the suite's flattened DCP keys
        (``"state.<name>.exp_avg"``, ``"param_groups.<name>.lr"``, ...; see
        :func:`~lightning_parallel.checkpoints.dcp.optimizer_state_dict`), and the names of each
        param group in ``checkpoint["lightning_parallel"]["param_groups"]`` where known; every
        other Lightning entry (loops, callbacks, lr_schedulers, ...) as saved, OmegaConf
        hyper-parameters as plain dicts and lists.

    Raises:
        CheckpointRefused: a truncated file or one holding objects beyond tensors and plain values.
        ValueError: not a Lightning checkpoint (the message says what it looks like), or optimizer
            state that cannot be matched to parameter names or is not per-element.
    """
    writer = identify_writer(path)
    if writer == "lightning-single-file":
        checkpoint = _single_file_as_checkpoint(Path(path), group_names, weights_only, optimizer_state)
    elif writer in ("lightning-dcp", "suite-dcp"):
        checkpoint = _dcp_as_checkpoint(resolve_checkpoint(Path(path)), optimizer_state, weights_only)
    else:
        raise unreadable_checkpoint_error(path, reader="read_lightning_checkpoint")
    return {key: value if key == "state_dict" else plain_containers(value) for key, value in checkpoint.items()}
