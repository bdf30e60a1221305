"""A local Hugging Face ``save_pretrained`` folder loaded onto an already parallelised module.

Each rank reads its own slices.

:func:`load_hf_weights` fills the module's parameters and persistent buffers in place from
``model.safetensors`` (or the shards an index file names). The folder's keys are matched to the
model's as ``from_pretrained`` matches them, through the model's own conversion mapping
(:mod:`.sources`): a mixture-of-experts folder holds one key per expert
(``mlp.experts.0.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.0.w1.weight``) where the
module holds ``experts.gate_up_proj [E, 2I, H]``; a fused folder holds the module's own keys. It runs
after the strategy has split and sharded the module, so each rank reads only what it holds:

- a DTensor (tensor parallelism, FSDP2, expert parallelism) reads exactly its local region: of a
  stacked experts tensor, only the experts this rank owns, each with ``safe_open(...).get_slice``
  (the file is memory-mapped; nothing else is materialised);
- a layer that lives on another pipeline stage (``RemovedLayer``) is skipped;
- a plain tensor reads the whole tensor once.

Tied weights: a checkpoint saved with ``tie_word_embeddings`` holds the LM head once, under
the embedding's name; every holder of the head (a tied parameter, or a pipeline stage's own
copy) is filled from it. Keys the module has but the folder lacks, keys the folder has that fit
no parameter on any stage, and shapes that differ are errors that name them and their likely
cause (:mod:`.mismatch`); :func:`match_folder` makes the same check on a ``meta`` model before
any process starts (``lp-train``'s preflight).

Note:
    Loading is in place (``copy_`` into the existing storage), so the optimizer Lightning
    already built keeps its references; values are cast to the parameter's dtype, as
    ``from_pretrained`` does for a model built in another dtype.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from lightning_parallel.checkpoints.hf.mismatch import Mismatch
from lightning_parallel.checkpoints.hf.sources import Region, Source, plan_sources
from lightning_parallel.parallel.materialize import local_region
from lightning_parallel.parallel.pipeline.stages import RemovedLayer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> dict[str, Path]:
    """``{key: safetensors file}`` of a ``save_pretrained`` folder (one file, or sharded with an index).

    Args:
        folder: the local folder.

    Raises:
        ValueError: no safetensors weights in it.
    """
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_FILE), framework="pt") as handle:
            return {key: folder / SINGLE_FILE for key in handle.keys()}
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "it is not a folder"
    raise ValueError(
        f"{str(folder)!r} holds no {SINGLE_FILE} nor {INDEX_FILE} ({present}): save the model with "
        "model.save_pretrained(folder) (safetensors, the default) or convert its .bin weights first."
    )


def tied_keys(module: nn.Module, prefix: str) -> dict[str, str]:
    """``{tied copy: source}`` of the Hugging Face model at ``prefix`` (``{}`` for one that ties nothing)."""
    try:
        model = module.get_submodule(prefix.rstrip(".")) if prefix else module
    except AttributeError:
        return {}
    return dict(getattr(model, "all_tied_weights_keys", None) or {})  # transformers leaves it empty when untied


def _targets(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers this rank holds under the Hugging Face model, by its key."""
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id"):
            raise ValueError(f"{name!r} is partitioned by DeepSpeed ZeRO-3: load the folder with from_pretrained in "
                             "configure_model (or before fit) under DeepSpeed; "
                             "HuggingFaceWeights serves the suite's layouts.")
    state = module.state_dict(keep_vars=True)
    return {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}


def _removed_prefixes(module: nn.Module, prefix: str) -> list[str]:
    names = [m.layer_name for m in module.modules() if isinstance(m, RemovedLayer)]
    return [name[len(prefix):] + "." for name in names if name.startswith(prefix)]


def stored_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a folder's tensors, read from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as handle:
            held = set(handle.keys())
            wanted = [key for key, where in files.items() if where == path]
            absent = sorted(set(wanted) - held)
            if absent:
                raise ValueError(f"{INDEX_FILE} in {str(path.parent)!r} places {', '.join(absent[:3])} in {path.name}, "
                                 "which does not hold it: the index belongs to other files; write the folder again "
                                 "with save_pretrained.")
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in wanted})
    return shapes


def _hf_model(module: nn.Module, prefix: str) -> nn.Module:
    return module.get_submodule(prefix.rstrip(".")) if prefix else module


@dataclass
class FolderMatch:
    """A folder matched to the tensors this rank holds (:func:`match_folder`).

    Attributes:
        targets: ``{model key: this rank's tensor}`` (keys relative to the Hugging Face model).
        sources: ``{model key: where it lies in the folder}`` for every target.
        files: ``{stored key: safetensors file}``.
    """

    targets: dict[str, torch.Tensor]
    sources: dict[str, Source]
    files: dict[str, Path]


def match_folder(module: nn.Module, folder: Path, prefix: str = "model.") -> FolderMatch:
    """Match a ``save_pretrained`` folder to ``module``'s Hugging Face model as ``from_pretrained`` would, checking
    keys and shapes from the files' headers only (``module`` may be on ``meta``; nothing is read or filled).

    Args:
        module: the LightningModule (or any module holding the model), split and sharded or not.
        folder: the folder.
        prefix: the model's attribute path in ``module`` plus a dot (``""`` for the model itself).

    Raises:
        ValueError: no safetensors weights; model tensors the folder lacks, folder keys that fit no tensor of the
            model on any stage, or shapes that differ (the message names them and what they point to: another
            configuration, another architecture, or a prefix); a tensor stored through a conversion the suite does
            not read in slices.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    files = weight_files(Path(folder))
    targets, tied = _targets(module, prefix), tied_keys(module, prefix)
    known = {key: tuple(tensor.shape) for key, tensor in targets.items()}
    for copy, source in tied.items():  # the copy's source lives on another stage: still matched, not filled
        if copy in known:
            known.setdefault(source, known[copy])
    model = _hf_model(module, prefix)
    plan = plan_sources(model, stored_shapes(files), known)
    unreadable = {key: op for key, op in plan.unreadable.items() if key in targets}
    if unreadable:
        key, op = next(iter(unreadable.items()))
        raise ValueError(f"{key!r} is stored in {str(folder)!r} through transformers' {op}, which the suite does not "
                         "read in slices: load the model with from_pretrained in configure_model instead.")
    sources = {key: plan.sources.get(key) or plan.sources.get(tied.get(key, "")) for key in targets}
    mismatch = _mismatch(sources, known, plan.unmatched, set(tied), _removed_prefixes(module, prefix))
    if mismatch:
        raise ValueError(mismatch.message(folder, prefix, model))
    return FolderMatch(targets, {key: source for key, source in sources.items() if source is not None}, files)


def _mismatch(sources: dict[str, Optional[Source]], known: dict[str, tuple[int, ...]], unmatched: dict[str, str],
              tied: set[str], removed: list[str]) -> Mismatch:
    """Targets without a source, folder keys that fill nothing here and are not another stage's or a tied copy,
    and shapes that differ."""
    def elsewhere(key: str, renamed: str) -> bool:
        return renamed in tied or any(name.startswith(r) for name in (key, renamed) for r in removed)

    return Mismatch(
        missing=sorted(key for key, source in sources.items() if source is None),
        unexpected=sorted(key for key, renamed in unmatched.items() if not elsewhere(key, renamed)),
        shapes={key: (source, known[key]) for key, source in sources.items()
                if source is not None and tuple(source.shape) != known[key]},
    )


class _Reader:
    """Reads stored regions, each file opened once per target and closed after it (:func:`_fill`)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files, self.handles, self.bytes = files, {}, 0
        self.stack = ExitStack()

    def __call__(self, key: str, region: Region) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[key]
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        handle = self.handles[path]
        data = handle.get_slice(key)[tuple(slice(a, b) for a, b in region)] if region else handle.get_tensor(key)
        self.bytes += data.nbytes
        return data

    def close(self) -> None:
        self.stack.close()
        self.handles = {}


def _fill(target: torch.Tensor, source: Source, reader: _Reader) -> None:
    """Copy this rank's part of ``source`` into ``target`` (a DTensor's local region, or the whole tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole = tuple((0, size) for size in target.shape)
    with torch.no_grad():
        if not isinstance(target, DTensor):
            target.copy_(source.read(whole, reader))
            return
        local = target.to_local()
        if local.numel() == 0:
            return
        region = local_region(target)
        if region is None:  # e.g. FSDP2 over a tensor-parallel dim: read whole, keep the local part
            data = distribute_tensor(source.read(whole, reader), target.device_mesh, target.placements,
                                     src_data_rank=None).to_local()
        else:
            data = source.read(tuple((s.start, s.stop) for s in region), reader)
        local.copy_(data)


def load_hf_weights(module: nn.Module, folder: Path, prefix: str = "model.") -> dict[str, int]:
    """Fill this rank's share of ``module``'s Hugging Face model from a local ``save_pretrained`` folder.

    Call it on every rank after the module is parallelised (no collectives are involved). The folder's keys are
    matched as ``from_pretrained`` matches them (:func:`match_folder`): per-expert or fused experts, renamed keys.

    Args:
        module: the parallelised LightningModule (or any module holding the Hugging Face model).
        folder: the folder ``save_pretrained`` wrote (``model.safetensors``, or shards with an index).
        prefix: the Hugging Face model's attribute path in ``module`` plus a dot (``""`` for the model itself).

    Returns:
        ``{"tensors": filled here, "bytes_read": bytes read by this rank}``.

    Raises:
        ValueError: see :func:`match_folder`.
    """
    match = match_folder(module, folder, prefix)
    reader = _Reader(match.files)
    for key, target in match.targets.items():
        # One mapping per tensor: the file's pages a rank touched leave its resident set as soon as it is filled.
        try:
            _fill(target, match.sources[key], reader)
        finally:
            reader.close()
    return {"tensors": len(match.targets), "bytes_read": reader.bytes}
