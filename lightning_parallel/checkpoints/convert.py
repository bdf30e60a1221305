"""``lp-convert SRC DST --to dcp|lightning|pt|hf``: the one command for every checkpoint conversion.

The source kind is detected: a DeepSpeed ZeRO folder (``latest``, ``*_model_states.pt``) or
the suite's DCP folder (``.metadata`` and ``meta.pt``). Available now::

    lp-convert ZERO_CKPT_DIR converted.ckpt   # DeepSpeed -> resumable DCP folder (--no-optimizer, --tag)
    lp-convert ZERO_CKPT_DIR model.pt         # DeepSpeed -> one plain state_dict (--tag)
    lp-convert CKPT_FOLDER model.pt           # DCP folder -> one plain state_dict

``--to`` defaults from DST's suffix: ``.pt``/``.pth``/``.bin`` -> ``pt``, anything else ->
``dcp``. ``lightning`` (a single-file Lightning checkpoint) and ``hf`` (a Hugging Face
folder) are accepted names that are refused with exit code 2 until they are implemented, as
is any request the source cannot serve; nothing is written then. Errors are one line
(``lp-convert: error: ...``), exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import CheckpointException

from lightning_parallel.checkpoints.dcp import is_sharded_checkpoint, resolve_checkpoint
from lightning_parallel.checkpoints.deepspeed_reader import is_deepspeed_folder
from lightning_parallel.checkpoints.export import PREFIX, export_state_dict
from lightning_parallel.checkpoints.from_deepspeed import convert_checkpoint, convert_to_dcp
from lightning_parallel.checkpoints.safe_loading import SafeFileSystemReader

PROG = "lp-convert"
FORMATS = ("dcp", "lightning", "pt", "hf")
# Extensions that select the plain state_dict output when --to is not given.
_PLAIN_SUFFIXES = (".pt", ".pth", ".bin")
_SOURCES = {"deepspeed": "a DeepSpeed checkpoint folder", "dcp": "a DCP checkpoint folder"}
# (source kind, --to) -> the conversion; every other pair is refused before anything is read.
_CONVERSIONS: dict[tuple[str, str], Callable[[argparse.Namespace], Path]] = {
    ("deepspeed", "dcp"): lambda a: convert_to_dcp(a.src, a.dst, a.tag, optimizer_state=not a.no_optimizer),
    ("deepspeed", "pt"): lambda a: convert_checkpoint(a.src, a.dst, a.tag),
    ("dcp", "pt"): lambda a: export_state_dict(a.src, a.dst),
}
AVAILABLE = "DeepSpeed -> dcp, DeepSpeed -> pt, DCP -> pt"
_LATER = {"lightning": "a single-file Lightning checkpoint", "hf": "a Hugging Face folder"}


def detect_source(src: Path) -> str:
    """``"deepspeed"`` or ``"dcp"``: the kind of checkpoint ``src`` is.

    Args:
        src: the path given as SRC.

    Raises:
        ValueError: neither kind (including a path that does not exist).
    """
    if is_sharded_checkpoint(resolve_checkpoint(src)):
        return "dcp"
    if is_deepspeed_folder(src):
        return "deepspeed"
    why = "it does not exist" if not src.exists() else "a file" if src.is_file() else "a folder without either's files"
    raise ValueError(
        f"{str(src)!r} ({why}) is not a DeepSpeed checkpoint folder ('latest', *_model_states.pt) nor a DCP "
        f"checkpoint folder (.metadata and meta.pt); conversions available now: {AVAILABLE}."
    )


def _plan(args: argparse.Namespace) -> tuple[str, str]:
    """The (source kind, output format) of a request, or ValueError for one that cannot be served."""
    to = args.to or ("pt" if args.dst.suffix in _PLAIN_SUFFIXES else "dcp")
    if to in _LATER:
        raise ValueError(f"--to {to} ({_LATER[to]}) is not available yet; conversions available now: {AVAILABLE}.")
    source = detect_source(args.src)
    if source == to:
        raise ValueError(f"{str(args.src)!r} is already {_SOURCES[source]}: use it as ckpt_path as it is, or --to pt.")
    if (source, to) not in _CONVERSIONS:
        raise ValueError(f"{_SOURCES[source]} -> {to} is not available; conversions available now: {AVAILABLE}.")
    if args.no_optimizer and to != "dcp":
        raise ValueError("--no-optimizer applies to the DCP output only (a .pt file holds weights only anyway).")
    if args.tag is not None and source != "deepspeed":
        raise ValueError("--tag applies to a DeepSpeed source only.")
    return source, to


def _one_line(error: BaseException) -> str:
    """A converter's error as one line; DCP's own exception by the errors it wraps (a truncated shard: EOFError)."""
    if isinstance(error, CheckpointException):
        causes = "; ".join(f"{type(cause).__name__} {cause}".strip() for cause, _ in error.failures.values())
        message = f"reading the DCP folder failed ({causes}): a damaged or incomplete checkpoint"
    else:
        message = str(error)
    return " ".join(message.split())


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _summary(out: Path, to: str, args: argparse.Namespace, seconds: float) -> str:
    """One line: what was written, with its tensors, values, bytes and the time taken."""
    if to == "pt":
        state = torch.load(out, map_location="cpu", weights_only=True, mmap=True)
        shapes = [tensor.shape for tensor in state.values()]
        return (f"wrote {out}: {len(shapes)} tensors, {sum(s.numel() for s in shapes):,} values, "
                f"{out.stat().st_size:,} bytes ({seconds:.1f}s)")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = SafeFileSystemReader(out).read_metadata().state_dict_metadata.items()
    shapes = [item.size for key, item in items if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)]
    optimizer = "reset to zero" if args.no_optimizer else "carried over"
    return (f"wrote DCP checkpoint {out}: {len(shapes)} tensors, {sum(s.numel() for s in shapes):,} values, "
            f"{_folder_bytes(out):,} bytes ({seconds:.1f}s); weights, optimizer state {optimizer}, Lightning state. "
            f"Resume with Trainer(strategy=...).fit(model, ckpt_path={str(out)!r}).")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", type=Path, help="a DeepSpeed checkpoint folder or a DCP checkpoint folder")
    parser.add_argument("dst", type=Path, help="the file or folder to write (an existing one is replaced)")
    parser.add_argument("--to", choices=FORMATS, default=None,
                        help="output format; default: pt when DST ends in .pt/.pth/.bin, dcp otherwise")
    parser.add_argument("--tag", default=None, help="DeepSpeed checkpoint tag (default: read from SRC/latest)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="DeepSpeed -> dcp only: write the optimizer state zeroed (it restarts)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lp-convert``; returns the exit code (0 done, 2 refused).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    try:
        source, to = _plan(args)
        out = _CONVERSIONS[(source, to)](args)
    except (ValueError, OSError, CheckpointException) as error:  # CheckpointRefused is a ValueError
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    print(_summary(out, to, args, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
