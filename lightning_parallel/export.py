"""Turn a sharded checkpoint folder into one plain ``state_dict`` file for inference.

    python -m lightning_parallel.export CHECKPOINT_DIR OUT.pt

The result is a ``{parameter name: tensor}`` dict under the unsplit model's names, loadable
with ``torch.load(OUT, weights_only=True)`` and ``model.load_state_dict(...)`` with no
process group, whatever layout wrote the checkpoint. For a DeepSpeed ZeRO checkpoint use
``python -m lightning_parallel.parallel.deepspeed_checkpoint`` instead.

Note:
    DCP can convert a whole checkpoint with ``format_utils.dcp_to_torch_save``, but that
    also unpickles every non-tensor entry without restriction and keeps the optimizer
    state; here only the model tensors are read, through the allow-listed reader.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

PREFIX = "state_dict."


def consolidate(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Read every model tensor of a sharded checkpoint in full (one process, no process group).

    Args:
        checkpoint: the checkpoint folder (``.../last.ckpt``).
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_parallel.parallel.checkpoint import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        is_sharded_checkpoint,
        resolve_checkpoint,
    )

    checkpoint = resolve_checkpoint(Path(checkpoint))
    if not is_sharded_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a sharded checkpoint folder (no .metadata and meta.pt inside).")
    reader = SafeFileSystemReader(checkpoint)
    metadata = reader.read_metadata()
    state = {
        key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)
    }
    load(state, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    return {key[len(PREFIX) :]: value for key, value in state.items()}


def export_state_dict(checkpoint: Path, out: Path) -> Path:
    """Write :func:`consolidate`'s result to ``out`` (atomically: a temporary file, then a rename).

    Args:
        checkpoint: the checkpoint folder.
        out: the ``.pt`` file to write.
    """
    out = Path(out)
    state = consolidate(Path(checkpoint))
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(state, tmp)
    tmp.replace(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="sharded checkpoint folder")
    parser.add_argument("out", type=Path, help="output .pt file")
    args = parser.parse_args()
    out = export_state_dict(args.checkpoint, args.out)
    state = torch.load(out, weights_only=True)
    print(f"wrote {out}: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} values")


if __name__ == "__main__":
    main()
