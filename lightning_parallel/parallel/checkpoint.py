"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), for any mix of pipeline stages,
DTensor shards and plain replicated tensors.

A checkpoint is a folder: DCP shards of ``{"state_dict": ..., "optimizer_0": ...}`` with every
tensor under its unsplit name and full shape (pipeline stages keep their original layer
names; DTensors are stored whole), plus ``meta.pt`` with Lightning's own state (loops,
callbacks, schedulers). DCP plans the writes so each rank writes its own tensors once, and
reshards on load: a rank reads exactly the slices its current layout holds.

Note:
    Lightning's ``ModelParallelStrategy`` writes this same layout but its loader insists on
    a model holding DTensors; a pipeline-only or replicated model holds none, so loading is
    done here with DCP directly. Optimizer state is *flattened* (one key per parameter and
    setting, as torchtitan does): the nested form stores ``param_groups`` as one object per
    checkpoint, which DCP de-duplicates across ranks -- pipeline stages, whose groups list
    different parameters, would then load another stage's groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

METADATA_FILE = "meta.pt"


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state under full parameter names, flattened for DCP (see the note above)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def is_sharded_checkpoint(path: Path) -> bool:
    """A DCP checkpoint folder written by the suite (or Lightning's ModelParallelStrategy)."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load this rank's share of the model and optimizer state; return Lightning's metadata.

    Every rank of the job must call it (DCP loads collectively).

    Args:
        path: the checkpoint folder.
        module: the parallelised model (pipeline stage, DTensor shards, FSDP2 units).
        optimizers: its optimizers, in Lightning's order (``optimizer_0``, ``optimizer_1``, ...).
        strict: every key of the module must be in the checkpoint.
        weights_only: passed to ``torch.load`` for ``meta.pt``.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_state = {"state_dict": get_model_state_dict(module)}
    load(model_state, checkpoint_id=path)
    set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=strict))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optim_state = {key: optimizer_state_dict(module, optimizer)}
        load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=flat)
    return torch.load(path / METADATA_FILE, weights_only=weights_only)
