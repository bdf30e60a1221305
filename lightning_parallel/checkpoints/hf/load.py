"""A local Hugging Face ``save_pretrained`` folder loaded onto an already parallelised module.

Each rank reads its own slices.

:func:`load_hf_weights` fills the module's parameters and persistent buffers in place from
``model.safetensors`` (or the shards an index file names), under the module's own names with
the attribute prefix of the Hugging Face model inside it (``model.``) added. It runs after
the strategy has split and sharded the module, so each rank reads only what it holds:

- a DTensor (tensor parallelism, FSDP2) reads exactly its local chunk with
  ``safe_open(...).get_slice`` (the file is memory-mapped; nothing else is materialised);
- a layer that lives on another pipeline stage (``RemovedLayer``) is skipped;
- a plain tensor reads the whole tensor once.

Tied weights: a checkpoint saved with ``tie_word_embeddings`` holds the LM head once, under
the embedding's name; every holder of the head (a tied parameter, or a pipeline stage's own
copy) is filled from it. Keys the module has but the folder lacks, and keys the folder has
that fit no parameter on any stage, are errors that name them.

Note:
    Loading is in place (``copy_`` into the existing storage), so the optimizer Lightning
    already built keeps its references; values are cast to the parameter's dtype, as
    ``from_pretrained`` does for a model built in another dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

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


def _fill(target: torch.Tensor, handle: Any, key: str) -> int:
    """Copy this rank's part of ``key`` into ``target``; returns the bytes read."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    shape = tuple(handle.get_slice(key).get_shape())
    if shape != tuple(target.shape):
        raise ValueError(f"{key!r} has shape {shape} in the folder but {tuple(target.shape)} in the model: "
                         "the folder holds another model configuration.")
    with torch.no_grad():
        if not isinstance(target, DTensor):
            data = handle.get_tensor(key)
            target.copy_(data)
            return data.nbytes
        region = local_region(target)
        if region is None:  # e.g. FSDP2 over a tensor-parallel dim: read whole, keep the local part
            data = distribute_tensor(handle.get_tensor(key), target.device_mesh, target.placements,
                                     src_data_rank=None).to_local()
        else:
            data = handle.get_slice(key)[region] if region else handle.get_tensor(key)
        target.to_local().copy_(data)
        return data.nbytes


def _by_file(wanted: dict[str, str], files: dict[str, Path]) -> Iterator[tuple[Path, list[tuple[str, str]]]]:
    """``(file, [(target key, stored key), ...])``, each file opened once."""
    grouped: dict[Path, list[tuple[str, str]]] = {}
    for target_key, stored_key in wanted.items():
        grouped.setdefault(files[stored_key], []).append((target_key, stored_key))
    yield from grouped.items()


def load_hf_weights(module: nn.Module, folder: Path, prefix: str = "model.") -> dict[str, int]:
    """Fill this rank's share of ``module``'s Hugging Face model from a local ``save_pretrained`` folder.

    Call it on every rank after the module is parallelised (no collectives are involved).

    Args:
        module: the parallelised LightningModule (or any module holding the Hugging Face model).
        folder: the folder ``save_pretrained`` wrote (``model.safetensors``, or shards with an index).
        prefix: the Hugging Face model's attribute path in ``module`` plus a dot (``""`` for the model itself).

    Returns:
        ``{"tensors": filled here, "bytes_read": bytes read by this rank}``.

    Raises:
        ValueError: keys missing from the folder or left over in it (named), a shape mismatch,
            or no safetensors weights in the folder.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    files = weight_files(Path(folder))
    targets = _targets(module, prefix)
    tied = tied_keys(module, prefix)
    wanted = {key: key if key in files else tied.get(key, key) for key in targets}
    missing = sorted(key for key, stored in wanted.items() if stored not in files)
    removed = _removed_prefixes(module, prefix)
    consumed = set(wanted.values()) | set(tied)
    unexpected = sorted(k for k in files if k not in consumed and not any(k.startswith(r) for r in removed))
    if missing or unexpected:
        raise ValueError(
            f"The folder {str(folder)!r} does not fit the model under prefix {prefix!r}: missing {len(missing)} "
            f"({', '.join(missing[:5])}), unexpected {len(unexpected)} ({', '.join(unexpected[:5])}). Check the "
            "prefix (the attribute holding the Hugging Face model) and that the folder holds the same architecture."
        )
    from safetensors import safe_open

    read = 0
    for path, pairs in _by_file(wanted, files):
        for target_key, stored_key in pairs:
            # One mapping per tensor: the file's pages a rank touched leave its resident set as soon as it is filled.
            with safe_open(str(path), framework="pt") as handle:
                read += _fill(targets[target_key], handle, stored_key)
    return {"tensors": len(wanted), "bytes_read": read}
