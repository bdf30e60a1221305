"""Resume a parallelised model from any checkpoint the suite can read, resharded onto its layout.

One load path for every writer (see :func:`~lightning_parallel.checkpoints.detect.identify_writer`):
the state is presented to DCP under the suite's unsharded keys and DCP copies each rank's
slices (:func:`~lightning_parallel.checkpoints.dcp.load_model_and_optimizers`).

- suite and Lightning DCP folders: read where they lie (each rank reads its slices).
- a Lightning single file: memory-mapped on every rank (``torch.load(mmap=True,
  weights_only=True)``) and served by :class:`~lightning_parallel.checkpoints.memory_reader.InMemoryReader`;
  a rank touches only the pages of its own slices, never a full copy. Optimizer positions
  are named from the live optimizers' param groups, gathered over all ranks.
- a DeepSpeed folder: converted once per node, by its local rank 0, into a temporary suite
  folder (:func:`~lightning_parallel.checkpoints.deepspeed.convert.convert_to_dcp`), which every
  rank then reads like any suite folder; the folder is removed afterwards.

Every rank must call :func:`resume_from` (the loads are collective).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.checkpoints.dcp import load_model_and_optimizers, load_sharded_checkpoint, resolve_checkpoint
from lightning_parallel.checkpoints.detect import describe_checkpoint, unreadable_checkpoint_error
from lightning_parallel.checkpoints.lightning.reader import load_single_file, single_file_entries
from lightning_parallel.checkpoints.memory_reader import InMemoryReader
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused

DROPPED = ("load_optimizer_state=False: loaded the weights, loops, LR schedulers and callbacks of {path}; its "
           "optimizer state ({what}) was dropped and the optimizer starts afresh as configure_optimizers builds it "
           "(zero moments, step 0, its own learning rates). Losses will differ from an uninterrupted run.")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_gather(value: Any) -> list[Any]:
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_group_names(
    module: nn.Module, optimizers: Sequence[Optimizer], order: Sequence[str]
) -> list[list[list[str]]]:
    """Per optimizer and param group, the names of its parameters on *all* ranks, in checkpoint order (collective).

    Args:
        module: this rank's part of the model (a pipeline stage holds only its layers).
        optimizers: this rank's optimizers.
        order: the checkpoint's weight names in saved order, which the saving optimizer followed.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    local = [[[names[id(p)] for p in group["params"] if id(p) in names] for group in optimizer.param_groups]
             for optimizer in optimizers]
    ranks = _all_gather(local)
    position = {name: i for i, name in enumerate(order)}
    by_position = lambda name: position.get(name, len(position))  # noqa: E731 - names the checkpoint lacks go last
    return [
        [sorted({n for rank in ranks for n in rank[o][g]}, key=by_position) for g in range(len(groups))]
        for o, groups in enumerate(local)
    ]


def _warn_dropped(path: Path, what: str) -> None:
    if not _distributed() or dist.get_rank() == 0:
        warnings.warn(DROPPED.format(path=str(path), what=what), stacklevel=3)


def _load_single_file(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, weights_only: Optional[bool]
) -> dict[str, Any]:
    checkpoint = load_single_file(path, weights_only)
    if "state_dict" not in checkpoint or (optimizers and "optimizer_states" not in checkpoint):
        raise ValueError(
            f"{str(path)!r} holds {'no weights' if 'state_dict' not in checkpoint else 'no optimizer state'} "
            "(ModelCheckpoint(save_weights_only=True)?): it cannot resume training. Load the weights with "
            "LightningModule.load_from_checkpoint and call fit without ckpt_path."
        )
    if optimizers:
        names = gather_group_names(module, optimizers, list(checkpoint["state_dict"]))
        single_file_entries(checkpoint, names)
    entries = {f"state_dict.{k}": v for k, v in checkpoint.pop("state_dict").items()}
    for index, state in enumerate(checkpoint.pop("optimizer_states", []) if optimizers else []):
        entries.update({f"optimizer_{index}.{k}": v for k, v in state.items()})
    checkpoint.pop("optimizer_states", None)
    trusted = weights_only is False  # the file was read with weights_only=False: its entries are the user's to trust
    load_model_and_optimizers(module, optimizers, lambda: InMemoryReader(entries), strict, trusted=trusted)
    return checkpoint


def _convert_deepspeed_on_each_node(
    path: Path, local_coordinator: bool, optimizer_state: bool, weights_only: Optional[bool]
) -> Path:
    """Local rank 0 of every node converts ``path`` into one node-local temporary suite folder.

    All ranks get its path. A folder refused by the allow-list raises :class:`CheckpointRefused` on every rank.
    """
    from lightning_parallel.checkpoints.deepspeed.convert import convert_to_dcp

    name = _all_gather(f"lightning_parallel-deepspeed-{uuid.uuid4().hex}")[0]
    folder = Path(tempfile.gettempdir()) / name / "converted.ckpt"
    error = None
    if local_coordinator:
        try:
            convert_to_dcp(path, folder, optimizer_state=optimizer_state, weights_only=weights_only)
        except (ValueError, OSError) as failure:
            error = (isinstance(failure, CheckpointRefused), str(failure))
    errors = [e for e in _all_gather(error) if e]
    if errors:  # every rank raises, none waits in a later collective
        if local_coordinator:
            shutil.rmtree(folder.parent, ignore_errors=True)
        refused, message = errors[0]
        raise (CheckpointRefused if refused else ValueError)(
            f"Reading the DeepSpeed checkpoint {str(path)!r} failed: {message}")
    return folder


def resume_from(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    load_optimizer_state: bool = True,
    weights_only: Optional[bool] = None,
    local_coordinator: bool = True,
    reader: str = "lightning_parallel",
) -> dict[str, Any]:
    """Load weights and optimizer state from any readable checkpoint; return Lightning's remaining entries.

    Args:
        path: ``ckpt_path`` (a suite or Lightning DCP folder, a Lightning single file, a DeepSpeed folder).
        module: the parallelised model.
        optimizers: its torch optimizers (empty outside fitting).
        strict: every weight of the module must be in the checkpoint.
        load_optimizer_state: ``False`` loads everything but the optimizer state (with a warning).
        weights_only: ``None``/``True``: every file is unpickled through the suite's allow-lists (single files,
            ``meta.pt``, DeepSpeed's files); ``False`` (``Trainer.fit(..., weights_only=False)``) admits any
            object in them, for a checkpoint the user trusts.
        local_coordinator: True on one rank per node (local rank 0), which converts DeepSpeed folders.
        reader: the strategy's name, for error messages.

    Raises:
        ValueError: a checkpoint the suite cannot read (the message names what it looks like and
            the fix), or state that does not fit the model and optimizers.
    """
    path = resolve_checkpoint(Path(path))
    writer, _ = describe_checkpoint(path)
    if writer == "unknown":
        raise unreadable_checkpoint_error(path, reader)
    loaded = list(optimizers) if load_optimizer_state else []
    if not load_optimizer_state and optimizers:
        _warn_dropped(path, "AdamW moments, step counts, SGD momentum, param-group settings")
    if writer == "lightning-single-file":
        return _load_single_file(path, module, loaded, strict, weights_only)
    if writer != "deepspeed":
        return load_sharded_checkpoint(path, module, loaded, strict, weights_only)
    folder = _convert_deepspeed_on_each_node(path, local_coordinator, load_optimizer_state, weights_only)
    try:
        return load_sharded_checkpoint(folder, module, loaded, strict, weights_only)
    finally:
        if _distributed():
            dist.barrier()
        if local_coordinator:
            shutil.rmtree(folder.parent, ignore_errors=True)
