"""Lightning's own checkpoints read into the suite's keys: a single ``.ckpt`` file or a DCP folder.

A single file (``trainer.save_checkpoint`` under Lightning's single-device, DDP or FSDP
full-state strategies) holds ``state_dict`` under the LightningModule's parameter names, and
``optimizer_states``: torch's optimizer ``state_dict`` with parameters as *positions*
(0, 1, ... over the param groups). A Lightning DCP folder (``ModelParallelStrategy``, or
``FSDPStrategy`` with sharded state under ``model``) names parameters but nests the param
groups as ``optimizer_0.param_groups.<group>.<setting>``. Both are turned into the suite's
form: weights under their names, optimizer state flattened per parameter
(``state.<name>.exp_avg``, ``param_groups.<name>.lr``), as
:func:`~lightning_parallel.checkpoints.dcp.optimizer_state_dict` writes it.

Note:
    Positions name parameters only together with the parameter order of the optimizer that
    saved them. :func:`name_positions` takes it from the caller (a strategy knows its own
    optimizer's groups; ``lp-convert --module`` asks the LightningModule) or, without it, infers
    it from the weights' order and the state's shapes
    (:mod:`~lightning_parallel.checkpoints.lightning.groups`), refusing rather than guessing
    when more than one assignment fits.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel.checkpoints.lightning.groups import infer_group_names
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused, refusal, safe_globals

# Lightning DCP folders: ModelParallelStrategy saves the weights under "state_dict", FSDPStrategy under "model".
MODEL_KEYS = ("state_dict", "model")
# Where the suite records the names of each param group: checkpoint["lightning_parallel"][ORDER_KEY].
ORDER_KEY = "param_groups"
NESTED_GROUP_KEY = re.compile(r"^(optimizer_\d+)\.param_groups\.(\d+)\.(\w+)$")
DROP_OPTIMIZER = "load_optimizer_state=False to the strategy (lp-convert: --no-optimizer)"


def load_single_file(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """``torch.load`` a single-file checkpoint memory-mapped, refusing damaged or non-plain content clearly.

    Args:
        path: the ``.ckpt`` file.
        weights_only: ``None``/``True``: only tensors, plain values and OmegaConf containers may be
            unpickled; ``False`` only for a file the user trusts (``Trainer.fit(weights_only=False)``).

    Raises:
        CheckpointRefused: truncated or damaged archive, or objects outside the allow-list.
    """
    try:
        with safe_globals():  # Hydra's hyper-parameters (OmegaConf containers) and nothing else beyond plain values
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only is not False)
    except pickle.UnpicklingError as error:
        raise refusal(path, error) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as error:
        raise CheckpointRefused(
            f"Refusing {str(path)!r}: it is truncated or damaged ({' '.join(str(error).split())[:160]}). "
            "Copy or save it again; a checkpoint cut short by a crash cannot be resumed."
        ) from None


def trainable_weights(state_dict: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """Floating-point entries of ``state_dict`` in order, a tied tensor once (as ``module.parameters()`` yields it)."""
    weights, seen = [], set()
    for name, value in state_dict.items():
        if torch.is_tensor(value) and value.is_floating_point():
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
            if key not in seen:
                seen.add(key)
                weights.append((name, value))
    return weights


def name_positions(
    optimizer_state: dict[str, Any], state_dict: dict[str, Any], group_names: Optional[Sequence[Sequence[str]]] = None
) -> dict[str, Any]:
    """torch's optimizer ``state_dict`` with parameter positions replaced by names.

    Args:
        optimizer_state: ``{"state": {position: {...}}, "param_groups": [{..., "params": [positions]}]}``.
        state_dict: the checkpoint's weights (shapes are checked against the state).
        group_names: the parameter names of each param group in the optimizer's order. Default:
            inferred from the weights' order and the state's shapes
            (:func:`~lightning_parallel.checkpoints.lightning.groups.infer_group_names`).

    Raises:
        ValueError: the groups do not match the names, or a state tensor is not laid out like
            its parameter (state that is not per-element cannot be re-split).
    """
    groups = optimizer_state["param_groups"]
    sizes = [len(group["params"]) for group in groups]
    if group_names is None:
        group_names = infer_group_names(optimizer_state, trainable_weights(state_dict))
    if [len(names) for names in group_names] != sizes:
        raise ValueError(
            f"Param-group mismatch: the checkpoint's optimizer has groups of {sizes} parameters, configure_optimizers "
            f"now builds groups of {[len(n) for n in group_names]}: "
            "the optimizer state cannot be matched to parameters. "
            f"Pass {DROP_OPTIMIZER} to load the weights and start the optimizer afresh."
        )
    state, named_groups = {}, []
    for group, names in zip(groups, group_names):
        for position, name in zip(group["params"], names):
            entry = optimizer_state["state"].get(position)
            if entry is not None:
                state[name] = check_per_element(name, entry, state_dict.get(name))
        named_groups.append({**group, "params": list(names)})
    return {"state": state, "param_groups": named_groups}


def check_per_element(name: str, entry: dict[str, Any], weight: Optional[torch.Tensor]) -> dict[str, Any]:
    """``entry`` if each of its tensors is a scalar or shaped like ``weight``; else ValueError naming the fix."""
    for key, value in entry.items():
        if isinstance(value, dict) or (torch.is_tensor(value) and value.dim() > 0 and (
                weight is None or tuple(value.shape) != tuple(weight.shape))):
            shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(
                f"Optimizer state {key!r} of {name!r} ({shape}) is not laid out like the parameter "
                f"({None if weight is None else tuple(weight.shape)}): only per-element state (Adam/AdamW moments, "
                f"SGD momentum) and scalars (step) can be resharded. Pass {DROP_OPTIMIZER} to load the weights and "
                "start the optimizer afresh."
            )
    return entry


def flatten_optimizer_state(named: dict[str, Any]) -> dict[str, Any]:
    """``{"state.<name>.<key>": ..., "param_groups.<name>.<setting>": ...}``: the suite's DCP optimizer keys.

    Args:
        named: torch's optimizer ``state_dict`` with names in place of positions.
    """
    flat: dict[str, Any] = {}
    for name, entry in named["state"].items():
        flat.update({f"state.{name}.{key}": value for key, value in entry.items()})
    for group in named["param_groups"]:
        settings = {key: value for key, value in group.items() if key != "params"}
        for name in group["params"]:
            flat.update({f"param_groups.{name}.{key}": value for key, value in settings.items()})
    return flat


def nested_param_groups(entries: dict[str, Any], optimizer_key: str) -> Optional[list[dict[str, Any]]]:
    """The param groups of a Lightning DCP folder's optimizer (``<key>.param_groups.<i>.<setting>``), or None.

    Args:
        entries: the folder's non-tensor entries by DCP key, already read.
        optimizer_key: ``"optimizer_0"``, ...
    """
    groups: dict[int, dict[str, Any]] = {}
    for key, value in entries.items():
        match = NESTED_GROUP_KEY.match(key)
        if match and match.group(1) == optimizer_key:
            groups.setdefault(int(match.group(2)), {})[match.group(3)] = value
    return [groups[i] for i in sorted(groups)] or None


def flatten_nested_groups(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Nested param groups (``params`` as names) as the suite's ``param_groups.<name>.<setting>`` keys."""
    return flatten_optimizer_state({"state": {}, "param_groups": groups})


def optimizer_group_names(
    checkpoint: dict[str, Any], group_names: Optional[Sequence[Sequence[Sequence[str]]]] = None
) -> list[list[list[str]]]:
    """Per optimizer of a loaded single file, the names of each param group: given, recorded, or inferred.

    Args:
        checkpoint: what :func:`load_single_file` returned.
        group_names: per optimizer, the names of each param group, when the caller knows them.
            Default: those ``lp-convert --to lightning`` recorded in the file, else inferred from the
            weights' order and the state's shapes.

    Raises:
        PositionsUnknown: inferring them is ambiguous.
    """
    states = checkpoint.get("optimizer_states") or []
    recorded = (checkpoint.get("lightning_parallel") or {}).get(ORDER_KEY)
    if group_names is None and recorded is not None and len(recorded) == len(states):
        group_names = recorded
    if group_names is not None:
        return [[list(names) for names in groups] for groups in group_names]
    weights = trainable_weights(checkpoint["state_dict"])
    return [infer_group_names(state, weights) for state in states]


def single_file_entries(
    checkpoint: dict[str, Any], group_names: Optional[Sequence[Sequence[Sequence[str]]]] = None
) -> dict[str, Any]:
    """A loaded single-file Lightning checkpoint with its optimizer states renamed and flattened.

    Args:
        checkpoint: what :func:`load_single_file` returned (modified in place and returned).
        group_names: per optimizer, the names of each param group (see :func:`name_positions`).
    """
    states = checkpoint.get("optimizer_states")
    if states:
        names = list(group_names) if group_names is not None else [None] * len(states)
        if len(names) != len(states):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizers, configure_optimizers now returns {len(names)}: "
                f"pass {DROP_OPTIMIZER} to load the weights only."
            )
        checkpoint["optimizer_states"] = [
            flatten_optimizer_state(name_positions(state, checkpoint["state_dict"], group))
            for state, group in zip(states, names)
        ]
    return checkpoint
