"""Turn a DeepSpeed checkpoint folder into one plain ``state_dict`` file.

``trainer.save_checkpoint(path)`` under :class:`~lightning_parallel.strategies.deepspeed.DeepSpeedDataParallelStrategy`
writes a *folder*: ``path/latest`` names a tag (``checkpoint``), and ``path/checkpoint/``
holds one model-state file and one optimizer-state shard per rank. Under ZeRO 1-3 the
fp32 weights live sharded in the optimizer files, so no single file holds the model.

:func:`consolidate_state_dict` gathers them (with DeepSpeed's own ``zero_to_fp32``) into
an ordinary ``{name: tensor}`` dict; :func:`convert_checkpoint` writes it with
``torch.save``. The result loads with ``model.load_state_dict(torch.load(file))`` on any
machine, in any layout, without DeepSpeed. From the shell::

    python -m lightning_parallel.parallel.deepspeed_checkpoint CKPT_DIR OUT.pt

Reading needs DeepSpeed installed (the shards are pickled with its classes); the output
does not. Run it on one process after training, not inside a distributed job.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

_PathLike = Union[str, os.PathLike]
# Lightning wrapped modules under this name in older versions; weights saved then carry it.
_WRAPPER_PREFIX = "_forward_module."
_MODEL_STATES = "mp_rank_00_model_states.pt"


def _resolve(checkpoint_dir: _PathLike, tag: Optional[str]) -> tuple[Path, str]:
    """The top-level folder and tag of a checkpoint given as the top folder or the tag folder."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is not a DeepSpeed checkpoint folder: pass the folder trainer.save_checkpoint wrote "
            "(it contains a 'latest' file and a 'checkpoint' folder)."
        )
    if tag is None and not (path / "latest").is_file() and any(path.glob("*_model_states.pt")):
        return path.parent, path.name  # the tag folder itself was given
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise ValueError(
                f"{str(path)!r} has no 'latest' file naming the checkpoint tag: pass tag= (--tag) or the tag folder."
            )
        tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise ValueError(f"Tag folder {str(path / tag)!r} does not exist: check tag= (--tag).")
    return path, tag


def _has_zero_shards(tag_dir: Path) -> bool:
    return any(tag_dir.glob("*_optim_states.pt"))


def consolidate_state_dict(checkpoint_dir: _PathLike, tag: Optional[str] = None) -> "OrderedDict[str, torch.Tensor]":
    """Gather a DeepSpeed checkpoint's weights into one fp32 ``state_dict`` on the CPU.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.

    Returns:
        Parameter (and buffer) names of the LightningModule mapped to full fp32 CPU tensors,
        ready for ``module.load_state_dict``.

    Raises:
        ValueError: the folder is not a DeepSpeed checkpoint.

    Note:
        ZeRO 1-3 keep the fp32 master weights in per-rank optimizer shards, which
        ``deepspeed.utils.zero_to_fp32`` knows how to stitch together (any world size).
        ZeRO stage 0 writes no shards: its full weights are in the model-state file.
    """
    top, tag = _resolve(checkpoint_dir, tag)
    tag_dir = top / tag
    if _has_zero_shards(tag_dir):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(top), tag=tag)
    else:
        model_file = tag_dir / _MODEL_STATES
        if not model_file.is_file():
            raise ValueError(f"{str(tag_dir)!r} holds neither ZeRO shards nor {_MODEL_STATES}: not a DeepSpeed checkpoint.")
        # Our own checkpoint, pickled with DeepSpeed objects: weights_only=False is needed to read it.
        state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
    consolidated: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, tensor in state.items():
        name = name[len(_WRAPPER_PREFIX) :] if name.startswith(_WRAPPER_PREFIX) else name
        tensor = tensor.detach().cpu()
        consolidated[name] = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
    return consolidated


def convert_checkpoint(checkpoint_dir: _PathLike, output_file: _PathLike, tag: Optional[str] = None) -> Path:
    """Write a DeepSpeed checkpoint's weights as one ``torch.save`` file of a plain ``state_dict``.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        output_file: the file to write (its folder is created); written to a temporary
            name first and renamed, so a failed run never leaves a half-written file.
        tag: the tag to read; default: the one named in ``latest``.

    Returns:
        The path written.
    """
    state = consolidate_state_dict(checkpoint_dir, tag)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    torch.save(state, partial)
    partial.replace(out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: ``python -m lightning_parallel.parallel.deepspeed_checkpoint CKPT_DIR OUT.pt [--tag TAG]``.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.parallel.deepspeed_checkpoint",
        description="Consolidate a DeepSpeed (ZeRO 0-3) checkpoint folder into one plain PyTorch state_dict file.",
    )
    parser.add_argument("checkpoint_dir", help="folder written by trainer.save_checkpoint under DeepSpeed")
    parser.add_argument("output_file", help="the .pt file to write (load it with torch.load + load_state_dict)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: read from CKPT_DIR/latest)")
    args = parser.parse_args(argv)
    try:
        out = convert_checkpoint(args.checkpoint_dir, args.output_file, args.tag)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = torch.load(out, map_location="cpu", weights_only=True)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {out}: {len(state)} tensors, {numel:,} values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
