"""``lp-convert SRC DST --to dcp|lightning|pt|hf``: the one command for every checkpoint conversion.

The source kind is detected from its files (:func:`~lightning_parallel.checkpoints.detect.identify_writer`):
the suite's DCP folder, a Lightning single-file checkpoint (one device, DDP, FSDP full state) or
Lightning DCP folder (``ModelParallelStrategy``, ``FSDPStrategy`` sharded), or a DeepSpeed ZeRO
folder; each converts to each output, this command's own outputs included::

    lp-convert ANY_CHECKPOINT model.ckpt --to lightning  # -> Trainer(strategy="auto"|"ddp").fit(ckpt_path=...)
    lp-convert ANY_CHECKPOINT hf_model --to hf           # -> AutoModelForCausalLM.from_pretrained("hf_model")
    lp-convert ANY_CHECKPOINT model.pt                   # -> one plain state_dict
    lp-convert ANY_CHECKPOINT converted.ckpt             # -> the suite's resumable DCP folder (--no-optimizer)

``--to`` defaults from DST's suffix: ``.pt``/``.pth``/``.bin`` -> ``pt``, anything else ->
``dcp``. ``--hf-config`` (a ``config.json`` or its folder) names the Hugging Face model for a
checkpoint that does not record it. A Lightning file and a DeepSpeed ZeRO-0 folder keep the
optimizer state by position; the positions are named from the weights' order and the state's
shapes, or, where that is ambiguous, by ``--module`` (the LightningModule class, whose
``configure_optimizers`` lists the groups). Weights-only outputs (pt, hf) read no optimizer
state. Any request the source cannot serve is refused before anything is written. Errors are one
line (``lp-convert: error: ...``), exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint import CheckpointException

from lightning_parallel.checkpoints.dcp import METADATA_FILE, resolve_checkpoint, save_on_one_process
from lightning_parallel.checkpoints.deepspeed.convert import (
    as_lightning_checkpoint,
    convert_checkpoint,
    convert_to_dcp,
)
from lightning_parallel.checkpoints.deepspeed.folder import (
    consolidate_state_dict,
    first_model_states,
    lightning_entries,
    resolve_folder,
)
from lightning_parallel.checkpoints.detect import describe_checkpoint, read_lightning_checkpoint
from lightning_parallel.checkpoints.hf.export import export_hf_folder
from lightning_parallel.checkpoints.lightning.groups import module_group_names
from lightning_parallel.checkpoints.lightning.reader import load_single_file
from lightning_parallel.checkpoints.lightning.writer import convert_to_lightning, rewrite_single_file
from lightning_parallel.checkpoints.pt import PREFIX, consolidate, export_state_dict, write_state_dict
from lightning_parallel.checkpoints.safe_loading import (
    SafeFileSystemReader,
    load_deepspeed_file,
    load_plain,
    plain_containers,
    safe_globals,
)

PROG = "lp-convert"
FORMATS = ("dcp", "lightning", "pt", "hf")
# Extensions that select the plain state_dict output when --to is not given.
_PLAIN_SUFFIXES = (".pt", ".pth", ".bin")
_SOURCES = {"suite-dcp": "a DCP checkpoint folder of lightning_parallel", "deepspeed": "a DeepSpeed checkpoint folder",
            "lightning-single-file": "a single-file Lightning checkpoint", "lightning-dcp": "a Lightning DCP folder"}
AVAILABLE = "a suite DCP folder, a Lightning file or DCP folder, or a DeepSpeed folder -> dcp|lightning|pt|hf"
# Sources whose optimizer state lists positions, not names: where --module can name them.
_POSITIONAL = ("lightning-single-file", "deepspeed")


def _weights_only(args: argparse.Namespace) -> Optional[bool]:
    return False if args.trust_source else None


def _hyper_parameters(args: argparse.Namespace) -> tuple[dict[str, Any], Optional[str]]:
    """The source's hyper-parameters (plain containers) and ``hparams_name``, to build ``--module`` from."""
    if detect_source(args.src) == "deepspeed":
        meta = _deepspeed_meta(args)
    else:
        meta = load_single_file(Path(args.src), _weights_only(args))
    return plain_containers(dict(meta.get("hyper_parameters") or {})), meta.get("hparams_name")


def _group_names(args: argparse.Namespace) -> Optional[list[list[list[str]]]]:
    """``--module``: per optimizer, the names of each param group, from the module's own configure_optimizers."""
    return None if args.module is None else module_group_names(args.module, *_hyper_parameters(args))


def _first(groups: Optional[list[list[list[str]]]]) -> Optional[list[list[str]]]:
    return None if groups is None else groups[0]  # a DeepSpeed engine steps one optimizer


def _read(args: argparse.Namespace, optimizer_state: bool) -> dict[str, Any]:
    """A Lightning (or suite) checkpoint in full; its optimizer state only when the output carries it."""
    names = _group_names(args) if optimizer_state else None
    return read_lightning_checkpoint(args.src, names, _weights_only(args), optimizer_state=optimizer_state)


def _lightning_to_dcp(args: argparse.Namespace) -> Path:
    """A Lightning (or suite) checkpoint as the suite's folder: weights, optimizer state by name, Lightning's
    entries, and the names of each param group (so the folder converts on to a Lightning file)."""
    checkpoint = _read(args, optimizer_state=not args.no_optimizer)
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": flat for i, flat in enumerate(checkpoint.pop("optimizer_states", None) or [])})
    source = describe_checkpoint(args.src)[1] + (", optimizer dropped" if args.no_optimizer else "")
    recorded = checkpoint.get("lightning_parallel") or {}
    checkpoint["lightning_parallel"] = {"layout": None, "zero_stage": 0, "schedule": None, **recorded, "source": source}
    return save_on_one_process(Path(args.dst), state, checkpoint)


def _deepspeed_meta(args: argparse.Namespace) -> dict[str, Any]:
    top, tag = resolve_folder(args.src, args.tag)
    return lightning_entries(load_deepspeed_file(first_model_states(top / tag), _weights_only(args)), top / tag)


def _to_hf(weights: dict[str, torch.Tensor], meta: dict[str, Any], args: argparse.Namespace) -> Path:
    out, outside = export_hf_folder(weights, args.dst, meta, args.hf_config)
    args.outside = outside
    return out


def _suite_meta(args: argparse.Namespace) -> dict[str, Any]:
    return load_plain(resolve_checkpoint(args.src) / METADATA_FILE, weights_only=not args.trust_source)


def _lightning_to_pt(args: argparse.Namespace) -> Path:
    return write_state_dict(dict(_read(args, optimizer_state=False)["state_dict"]), args.dst)


def _lightning_to_hf(args: argparse.Namespace) -> Path:
    checkpoint = _read(args, optimizer_state=False)
    return _to_hf(checkpoint.pop("state_dict"), checkpoint, args)


def _deepspeed_to_lightning(args: argparse.Namespace) -> Path:
    groups = _first(_group_names(args)) if not args.no_optimizer else None
    checkpoint = as_lightning_checkpoint(args.src, args.tag, not args.no_optimizer, groups, _weights_only(args))
    return write_state_dict(checkpoint, args.dst)


def _deepspeed_to_dcp(args: argparse.Namespace) -> Path:
    groups = _first(_group_names(args))
    return convert_to_dcp(args.src, args.dst, args.tag, optimizer_state=not args.no_optimizer, group_names=groups,
                          weights_only=_weights_only(args))


# (source kind, --to) -> the conversion: every source converts to every output.
_CONVERSIONS: dict[tuple[str, str], Callable[[argparse.Namespace], Path]] = {
    ("deepspeed", "dcp"): _deepspeed_to_dcp,
    ("deepspeed", "lightning"): _deepspeed_to_lightning,
    ("deepspeed", "pt"): lambda a: convert_checkpoint(a.src, a.dst, a.tag, _weights_only(a)),
    ("deepspeed", "hf"): lambda a: _to_hf(consolidate_state_dict(a.src, a.tag, _weights_only(a)), _deepspeed_meta(a),
                                          a),
    ("suite-dcp", "dcp"): _lightning_to_dcp,
    ("suite-dcp", "pt"): lambda a: export_state_dict(a.src, a.dst),
    ("suite-dcp", "lightning"): lambda a: convert_to_lightning(a.src, a.dst, not a.no_optimizer, _weights_only(a)),
    ("suite-dcp", "hf"): lambda a: _to_hf(consolidate(a.src), _suite_meta(a), a),
    ("lightning-dcp", "dcp"): _lightning_to_dcp,
    ("lightning-dcp", "lightning"): lambda a: convert_to_lightning(a.src, a.dst, not a.no_optimizer, _weights_only(a)),
    ("lightning-dcp", "pt"): _lightning_to_pt,
    ("lightning-dcp", "hf"): _lightning_to_hf,
    ("lightning-single-file", "dcp"): _lightning_to_dcp,
    ("lightning-single-file", "lightning"): lambda a: rewrite_single_file(
        a.src, a.dst, optimizer_state=not a.no_optimizer, weights_only=_weights_only(a)),
    ("lightning-single-file", "pt"): _lightning_to_pt,
    ("lightning-single-file", "hf"): _lightning_to_hf,
}


def detect_source(src: Path) -> str:
    """The kind of checkpoint ``src`` is: ``suite-dcp``, ``lightning-single-file``, ``lightning-dcp`` or ``deepspeed``.

    Args:
        src: the path given as SRC.

    Raises:
        ValueError: none of them, saying what ``src`` looks like.
    """
    writer, description = describe_checkpoint(src)
    if writer not in _SOURCES:
        raise ValueError(f"{str(src)!r} is not a DeepSpeed checkpoint folder, a DCP checkpoint folder nor a Lightning "
                         f"checkpoint: it looks like {description}. "
                         f"Conversions available: {AVAILABLE}.")
    return writer


def _plan(args: argparse.Namespace) -> tuple[str, str]:
    """The (source kind, output format) of a request, or ValueError for one that cannot be served."""
    to = args.to or ("pt" if args.dst.suffix in _PLAIN_SUFFIXES else "dcp")
    source = detect_source(args.src)
    if args.no_optimizer and to not in ("dcp", "lightning"):
        raise ValueError("--no-optimizer applies to the dcp and lightning outputs only (pt and hf hold weights only).")
    if args.tag is not None and source != "deepspeed":
        raise ValueError("--tag applies to a DeepSpeed source only.")
    if args.hf_config is not None and to != "hf":
        raise ValueError("--hf-config applies to --to hf only.")
    if args.module is not None and (source not in _POSITIONAL or to not in ("dcp", "lightning") or args.no_optimizer):
        raise ValueError("--module applies where optimizer state by position is converted with its names: a "
                         "Lightning file or DeepSpeed folder to dcp or lightning, without --no-optimizer.")
    return source, to


def _one_line(error: BaseException) -> str:
    """A converter's error as one line; DCP's own exception by the errors it wraps (a truncated shard: EOFError)."""
    if isinstance(error, CheckpointException):
        causes = "; ".join(f"{type(cause).__name__} {cause}".strip() for cause, _ in error.failures.values())
        message = f"reading the DCP folder failed ({causes}): a damaged or incomplete checkpoint"
    else:
        message = str(error)
    return " ".join(message.split())


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def _counts(tensors: Sequence[torch.Size]) -> str:
    return f"{len(tensors)} tensors, {sum(s.numel() for s in tensors):,} values"


def _summary(out: Path, to: str, args: argparse.Namespace, seconds: float) -> str:
    """One line: what was written, with its tensors, values, bytes and the time taken."""
    took = f"{_bytes(out):,} bytes ({seconds:.1f}s)"
    if to in ("pt", "lightning"):
        with safe_globals():  # what the source held: OmegaConf containers, or anything under --trust-source
            state = torch.load(out, map_location="cpu", weights_only=not args.trust_source, mmap=True)
        weights = state["state_dict"] if to == "lightning" else state
        line = f"wrote {out}: {_counts([t.shape for t in weights.values()])}, {took}"
        if to == "lightning":
            optimizer = "none" if args.no_optimizer else f"{len(state.get('optimizer_states', []))} optimizer(s)"
            line += (f"; {optimizer}, Lightning state at global step {state.get('global_step')}. Resume with "
                     f"Trainer(strategy='auto' or 'ddp').fit(model, ckpt_path={str(out)!r}).")
        return line
    if to == "hf":
        outside = getattr(args, "outside", [])
        left = f"; not part of the Hugging Face model, left out: {', '.join(outside)}" if outside else ""
        return f"wrote Hugging Face folder {out}: {took}{left}. Load with from_pretrained({str(out)!r})."
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    items = SafeFileSystemReader(out).read_metadata().state_dict_metadata.items()
    shapes = [item.size for key, item in items if key.startswith(PREFIX) and isinstance(item, TensorStorageMetadata)]
    optimizer = "carried over"
    if args.no_optimizer:  # DeepSpeed sources write the keys zeroed where their names are known
        zeroed = any(key.startswith("optimizer_") for key, _ in items)
        optimizer = "reset to zero" if zeroed else "left out (the strategy must start it afresh)"
    return (f"wrote DCP checkpoint {out}: {_counts(shapes)}, {took}; weights, optimizer state {optimizer}, Lightning "
            f"state. Resume with Trainer(strategy=...).fit(model, ckpt_path={str(out)!r}).")


def _parser() -> argparse.ArgumentParser:
    from lightning_parallel.cli.help_text import DOCS, plain

    parser = argparse.ArgumentParser(
        prog=PROG, description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Docs: docs/checkpoints.md.\nEverything: {DOCS}.",
    )
    parser.add_argument("src", type=Path,
                        help="a suite or Lightning checkpoint (file or DCP folder), or a DeepSpeed folder")
    parser.add_argument("dst", type=Path, help="the file or folder to write (an existing one is replaced)")
    parser.add_argument("--to", choices=FORMATS, default=None,
                        help="output format; default: pt when DST ends in .pt/.pth/.bin, dcp otherwise")
    parser.add_argument("--tag", default=None, help="DeepSpeed checkpoint tag (default: read from SRC/latest)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="dcp/lightning outputs: leave the optimizer state out (DeepSpeed -> dcp: zeroed)")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="--to hf: the model's config.json (or its folder) when the checkpoint does not record it")
    parser.add_argument("--module", default=None, metavar="PACKAGE.MODULE.CLASS",
                        help="the LightningModule that wrote SRC, built from its hyper-parameters on the meta device: "
                             "its configure_optimizers names the param groups when the positions of a Lightning file "
                             "or DeepSpeed ZeRO-0 folder cannot be matched to parameters from the file alone")
    parser.add_argument("--trust-source", action="store_true",
                        help="a source holding objects beyond tensors, plain values and the allow-listed classes "
                             "(a Lightning file, a DeepSpeed folder, a DCP folder's meta.pt): unpickle them "
                             "(weights_only=False; runs whatever the files hold: only for checkpoints you trust). "
                             "By default such a source is refused. A DCP folder's .metadata is never trusted")
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
