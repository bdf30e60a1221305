"""A sharded checkpoint folder as one plain ``state_dict`` file, for inference.

The result is a ``{parameter name: tensor}`` dict under the unsplit model's names, loadable
with ``torch.load(OUT, weights_only=True)`` and ``model.load_state_dict(...)`` with no
process group, whatever layout wrote the checkpoint (``lp-convert CKPT_DIR OUT.pt``). A
DeepSpeed ZeRO folder goes through :func:`~lightning_parallel.checkpoints.convert_checkpoint`.

Note:
    DCP can convert a whole checkpoint with ``format_utils.dcp_to_torch_save``, but that
    also unpickles every non-tensor entry without restriction and keeps the optimizer
    state; here only the model tensors are read, through the allow-listed reader.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_parallel.checkpoints.dcp import is_sharded_checkpoint, resolve_checkpoint, single_process
from lightning_parallel.checkpoints.safe_loading import SafeFileSystemReader, SafeLoadPlanner, refusals_unwrapped

PREFIX = "state_dict."


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Read every model tensor of a sharded checkpoint in full (one process, no process group).

    Args:
        checkpoint: the checkpoint folder (``.../last.ckpt``).

    Raises:
        ValueError: the folder is not a sharded checkpoint.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint = resolve_checkpoint(Path(checkpoint))
    if not is_sharded_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a sharded checkpoint folder (no .metadata and meta.pt inside).")
    metadata = SafeFileSystemReader(checkpoint).read_metadata()
    state = {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)
    }
    with single_process():
        with refusals_unwrapped():
            load(state, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    return {key[len(PREFIX) :]: value for key, value in state.items()}


def write_state_dict(state: dict[str, torch.Tensor], out: Path) -> Path:
    """``torch.save`` a plain state dict so that ``out`` is either complete or untouched.

    It is written under the hidden name ``.<name>.partial`` first and renamed, so a failed
    run never leaves a half-written file under ``out``.

    Args:
        state: ``{name: tensor}``.
        out: the file to write (its folder is created).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    torch.save(state, partial)
    partial.replace(out)
    return out


def export_state_dict(checkpoint: Path, out: Path) -> Path:
    """Write :func:`consolidate`'s result to ``out`` (atomically: a temporary file, then a rename).

    Args:
        checkpoint: the checkpoint folder.
        out: the ``.pt`` file to write.

    Returns:
        The path written.
    """
    return write_state_dict(consolidate(Path(checkpoint)), out)
