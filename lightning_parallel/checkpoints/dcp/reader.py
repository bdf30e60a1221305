"""Read a DCP checkpoint folder (the suite's, or Lightning's ``ModelParallelStrategy``/``FSDPStrategy`` ones) onto
this rank's layout: the model's weights and optimizer state resharded by DCP, each entry checked against the live
objects first, Lightning's metadata read back allow-listed (:mod:`~lightning_parallel.checkpoints.safe_loading`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.checkpoints.dcp.writer import METADATA_FILE
from lightning_parallel.checkpoints.lightning.reader import NESTED_GROUP_KEY, flatten_nested_groups, nested_param_groups
from lightning_parallel.checkpoints.safe_loading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_plain,
    refusals_unwrapped,
)


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state under full parameter names, flattened for DCP (see the module note).

    Args:
        module: the parallelised model the optimizer steps.
        optimizer: the torch optimizer (unwrapped from Lightning's).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def is_sharded_checkpoint(path: Path) -> bool:
    """A DCP checkpoint folder written by the suite (or Lightning's ModelParallelStrategy).

    Args:
        path: any path.
    """
    return path.is_dir() and (path / ".metadata").is_file() and (path / METADATA_FILE).is_file()


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load this rank's share of the model and optimizer state; return Lightning's metadata.

    Every rank of the job must call it (DCP loads collectively). A Lightning DCP folder
    (``ModelParallelStrategy``: nested param groups; ``FSDPStrategy``: weights under
    ``model``) loads the same way.

    Args:
        path: the checkpoint folder.
        module: the parallelised model (pipeline stage, DTensor shards, FSDP2 units).
        optimizers: its optimizers, in Lightning's order (``optimizer_0``, ``optimizer_1``, ...);
            empty to leave them as they are (weights only).
        strict: every key of the module must be in the checkpoint.
        weights_only: passed to ``torch.load`` for ``meta.pt``.
    """
    open_reader = lambda: SafeFileSystemReader(path)  # noqa: E731 - DCP wants a fresh reader per load
    stored = open_reader().read_metadata().state_dict_metadata
    # Refused before anything is loaded into the module (a tampered meta.pt leaves the model as it was).
    meta = load_plain(path / METADATA_FILE, weights_only=True if weights_only is None else weights_only)
    model_key = "model" if any(k.startswith("model.") for k in stored) and not any(
        k.startswith("state_dict.") for k in stored) else "state_dict"
    groups = {}
    for index in range(len(optimizers)):
        with refusals_unwrapped():
            nested = read_nested_param_groups(open_reader, stored, f"optimizer_{index}")
        if nested is not None:
            groups[f"optimizer_{index}"] = nested
    with refusals_unwrapped():
        load_model_and_optimizers(module, optimizers, open_reader, strict, model_key, groups)
    return meta


def read_nested_param_groups(
    open_reader: Callable[[], Any], stored: dict[str, Any], key: str
) -> Optional[dict[str, Any]]:
    """Lightning DCP folders nest param groups (``<key>.param_groups.<i>.<setting>``): read them as suite keys.

    Returns None for the suite's own flattened form (``<key>.param_groups.<name>.<setting>``).
    """
    from torch.distributed.checkpoint import load

    wanted = {k: None for k in stored if NESTED_GROUP_KEY.match(k) and k.startswith(f"{key}.")}
    if not any(k.endswith(".params") for k in wanted):  # the suite never stores a "params" setting
        return None
    load(wanted, storage_reader=open_reader(), planner=SafeLoadPlanner())
    return flatten_nested_groups(nested_param_groups(wanted, key))


def load_model_and_optimizers(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    open_reader: Callable[[], Any],
    strict: bool = True,
    model_key: str = "state_dict",
    param_groups: Optional[dict[str, dict[str, Any]]] = None,
    trusted: bool = False,
) -> None:
    """Reshard model and optimizer state from any DCP storage reader onto this rank's layout (collective).

    Args:
        module: the parallelised model.
        optimizers: its optimizers (``optimizer_0``, ... in the storage); empty: weights only.
        open_reader: returns a fresh DCP ``StorageReader`` (a folder's, or an in-memory one).
        strict: every key of the module must be in the checkpoint.
        model_key: the storage's prefix of the weights (``state_dict``; ``model`` for FSDPStrategy).
        param_groups: per optimizer key, ``param_groups.<name>.<setting>`` values given in memory
            instead of read from storage (Lightning's nested groups).
        trusted: the reader serves a file the user trusts from memory: its non-tensor entries are not
            checked again (see :class:`~lightning_parallel.checkpoints.safe_loading.SafeLoadPlanner`).

    Raises:
        ValueError: the checkpoint lacks weights or optimizer state the live objects need, holds
            them in another shape, or puts one param group's parameters in groups that disagree.
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    stored = open_reader().read_metadata().state_dict_metadata
    weights = get_model_state_dict(module)
    to_read = check_entries(model_key, weights, stored, strict)
    load({model_key: to_read}, storage_reader=open_reader(), planner=SafeLoadPlanner(trusted))
    weights.update(to_read)
    set_model_state_dict(module, weights, options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        expected = optimizer_state_dict(module, optimizer)
        given = (param_groups or {}).get(key)
        to_read = check_entries(key, expected, stored, True, given)
        load({key: to_read}, storage_reader=open_reader(), planner=SafeLoadPlanner(trusted))
        expected.update(to_read)
        check_group_agreement(module, optimizer, expected)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=expected,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))


def check_entries(
    key: str, expected: dict[str, Any], stored: dict[str, Any], strict: bool, given: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """The entries of ``expected`` to read from storage; fills ``expected`` from ``given`` or keeps settings it lacks.

    Raises:
        ValueError: a weight or optimizer-state tensor missing from storage or stored in another shape.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    to_read, missing, reshaped = {}, [], []
    for name, value in expected.items():
        if name.startswith("param_groups.") and given is not None:
            if name not in given:
                missing.append(name)
            else:
                expected[name] = given[name]
            continue
        item = stored.get(f"{key}.{name}")
        if item is None:
            # A param-group setting newer than the checkpoint keeps the optimizer's own value.
            if strict and not name.startswith("param_groups."):
                missing.append(name)
            continue
        if torch.is_tensor(value) and (
            not isinstance(item, TensorStorageMetadata) or tuple(item.size) != tuple(value.shape)
        ):
            reshaped.append(f"{name} {tuple(getattr(item, 'size', ()))} vs {tuple(value.shape)}")
        to_read[name] = value
    if missing or reshaped:
        what = "weights" if key in ("state_dict", "model") else "optimizer state"
        raise ValueError(
            f"The checkpoint's {what} does not fit the model and optimizer being trained: "
            f"{len(missing)} entries missing ({', '.join(missing[:3])}), {len(reshaped)} of another shape "
            f"({', '.join(reshaped[:3])}). A different model, optimizer class or param groups? For the optimizer, "
            "pass load_optimizer_state=False to the strategy to load the weights and start the optimizer afresh."
        )
    return to_read


def _same(a: Any, b: Any) -> bool:
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b)) if torch.is_tensor(a) or torch.is_tensor(b) else a == b


def check_group_agreement(module: nn.Module, optimizer: Optimizer, flat: dict[str, Any]) -> None:
    """Each live param group's parameters must come with the same saved settings (lr, betas, ...).

    Raises:
        ValueError: a param-group mismatch (torch would silently take the first parameter's values).
    """
    # A tied parameter under its first name, as torch.distributed.checkpoint files its optimizer state (the last
    # name, e.g. a tied LM head, found no saved settings and failed every resume of a tied model).
    names = {id(p): n for n, p in module.named_parameters()}
    for index, group in enumerate(optimizer.param_groups):
        settings = [k for k in group if k != "params"]
        first: Optional[str] = None
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                continue
            first = first or name
            for setting in settings:
                a, b = flat.get(f"param_groups.{first}.{setting}"), flat.get(f"param_groups.{name}.{setting}")
                if not _same(a, b):
                    raise ValueError(
                        f"Param-group mismatch: group {index} of the optimizer holds {first!r} and {name!r}, "
                        f"saved with {setting}={a!r} and {b!r}. configure_optimizers groups parameters differently "
                        "from the run that saved the checkpoint; pass load_optimizer_state=False to start the "
                        "optimizer afresh."
                    )
