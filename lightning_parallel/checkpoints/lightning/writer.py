"""A suite (or Lightning DCP) checkpoint folder as one Lightning checkpoint file that Lightning's own strategies resume.

``lp-convert CKPT_DIR OUT.ckpt --to lightning`` writes what ``trainer.save_checkpoint`` writes
under Lightning's single-device and DDP strategies: full ``state_dict`` weights,
``optimizer_states`` as ``torch.optim.Optimizer.state_dict()`` gives them (state keyed by
parameter *index*, param groups listing indices), and Lightning's own entries (loops,
callbacks, LR schedulers, epoch, global step, hyper-parameters) as they were saved (OmegaConf
containers as plain dicts and lists, which Lightning's default ``weights_only=True`` load takes), so
``Trainer(strategy="auto"|"ddp").fit(model, ckpt_path=OUT)`` continues the run exactly. The file
also keeps ``{"lightning_parallel": {"param_groups": names}}`` (Lightning ignores it), so converting
it again names its positions exactly. :func:`rewrite_single_file` writes a Lightning file again
(``--to lightning`` of a Lightning file).

Note:
    The suite stores optimizer state *by parameter name* (flattened for DCP, see
    :mod:`~lightning_parallel.checkpoints.dcp`), which is what lets any layout reload it.
    An index-keyed state needs the order in which ``configure_optimizers`` listed the
    parameters of the *unsplit* module, which a name-keyed state does not hold. The suite's
    strategies therefore record it at save time (:func:`parameter_order_entry`, stored in
    ``checkpoint["lightning_parallel"]["param_groups"]``); a folder without it is refused
    rather than written with a guessed order, which would silently swap moments between
    parameters. Lightning's own DCP folders (``ModelParallelStrategy``, sharded
    ``FSDPStrategy``) keep torch's nested param groups, which list the names in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.checkpoints.dcp import METADATA_FILE, is_sharded_checkpoint, resolve_checkpoint, single_process
from lightning_parallel.checkpoints.lightning.reader import (
    MODEL_KEYS,
    ORDER_KEY,
    flatten_nested_groups,
    load_single_file,
    nested_param_groups,
)
from lightning_parallel.checkpoints.pt import write_state_dict
from lightning_parallel.checkpoints.safe_loading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_plain,
    plain_containers,
    refusals_unwrapped,
)
from lightning_parallel.parallel.pipeline.stages import RemovedLayer
from lightning_parallel.parallel.pipeline.tied import TIED_COPY_ATTR

TIED_KEY = "tied_copies"
# Entries of meta.pt that only the suite reads; the Lightning file carries only the param groups' names of it.
_SUITE_ONLY = ("lightning_parallel",)


def _module_order(module: nn.Module) -> list[str]:
    """Parameter names in ``named_parameters`` order, with ``@<layer>`` where a pipeline layer was removed."""
    tokens = []
    for name, child in module.named_modules():
        if isinstance(child, RemovedLayer):
            tokens.append(f"@{child.layer_name}")
            continue
        tokens.extend(f"{name}.{leaf}" if name else leaf for leaf, param in child.named_parameters(recurse=False)
                      if not getattr(param, TIED_COPY_ATTR, False))
    return tokens


def _global_order(skeletons: Sequence[list[str]]) -> list[str]:
    """The unsplit module's parameter order, from every rank's :func:`_module_order` (removed layers filled in)."""
    removed = {token[1:] for tokens in skeletons for token in tokens if token.startswith("@")}
    owned: dict[str, list[str]] = {}
    for tokens in skeletons:
        for token in tokens:
            parts = token.split(".")
            layer = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in removed), None)
            if layer is not None and token not in owned.setdefault(layer, []):
                owned[layer].append(token)
    order: list[str] = []
    for token in skeletons[0]:
        order.extend(owned.get(token[1:], []) if token.startswith("@") else [token])
    return order


def _local_groups(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[list[list[str]]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [[[names[id(p)] for p in group["params"] if not getattr(p, TIED_COPY_ATTR, False)]
             for group in opt.param_groups] for opt in optimizers]


def merge_parameter_groups(
    skeletons: Sequence[list[str]], local: Sequence[list[list[list[str]]]]
) -> Optional[list[list[list[str]]]]:
    """The unsplit module's ``[optimizer][group] -> parameter names``, from every rank's view; None if unknowable.

    Without pipeline stages every rank's optimizer lists every parameter, so any rank's lists
    are exact. With stages, each rank lists its own parameters; their union is put in module
    order, which is exact when ``configure_optimizers`` lists each group in module order (as
    ``self.parameters()`` and filtered ``named_parameters()`` do). A rank whose own list is
    not in module order makes the order unknowable: None.

    Args:
        skeletons: :func:`_module_order` of every rank.
        local: the ``[optimizer][group] -> names`` of every rank.
    """
    if not any(t.startswith("@") for tokens in skeletons for t in tokens):
        return [list(map(list, groups)) for groups in local[0]]
    position = {name: index for index, name in enumerate(_global_order(skeletons))}
    merged = []
    for opt_index, groups in enumerate(local[0]):
        if any(len(rank_groups[opt_index]) != len(groups) for rank_groups in local):
            return None  # a stage dropped an empty group: group indices no longer line up
        merged.append([])
        for group_index in range(len(groups)):
            per_rank = [rank_groups[opt_index][group_index] for rank_groups in local]
            keys = [[position.get(name, -1) for name in names] for names in per_rank]
            if any(-1 in k or k != sorted(k) for k in keys):
                return None
            merged[-1].append(sorted({n for names in per_rank for n in names}, key=position.__getitem__))
    return merged


def parameter_order_entry(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """What a strategy adds to ``checkpoint["lightning_parallel"]`` at save time (call on every rank).

    Collective when a process group exists (one ``all_gather_object``); the same value on every rank.

    Args:
        module: the parallelised module the optimizers step (names relative to it).
        optimizers: the torch optimizers, in Lightning's order.

    Returns:
        ``{"param_groups": [optimizer][group] -> parameter names`` in the order
        ``configure_optimizers`` gives on the unsplit module, or None when that order cannot
        be recovered (see :func:`merge_parameter_groups`); ``"tied_copies"``: names of the
        further copies of tied parameters split over pipeline stages (one parameter unsplit)}.
    """
    import torch.distributed as dist

    copies = sorted(n for n, p in module.named_parameters() if getattr(p, TIED_COPY_ATTR, False))
    mine = (_module_order(module), _local_groups(module, optimizers), copies)
    views = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
    groups = merge_parameter_groups([v[0] for v in views], [v[1] for v in views])
    return {ORDER_KEY: groups, TIED_KEY: sorted({n for v in views for n in v[2]})}


def _read_entries(checkpoint: Path, prefix: str) -> dict[str, Any]:
    """Every DCP entry whose key starts with ``prefix`` (tensors in full, plain values as stored)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(checkpoint).read_metadata().state_dict_metadata
    state = {
        key: (
            torch.empty(tuple(item.size), dtype=item.properties.dtype)
            if isinstance(item, TensorStorageMetadata)
            else None
        )
        for key, item in metadata.items() if key.startswith(prefix)
    }
    with single_process():
        with refusals_unwrapped():
            load(state, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True)
    return {key[len(prefix):]: value for key, value in state.items()}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}`` (nested optimizer state such as Shampoo's)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *path, leaf = key.split(".")
        target = nested
        for part in path:
            target = target.setdefault(part, {})
        target[leaf] = value
    return nested


def _by_parameter(entries: dict[str, Any], names: set[str], where: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``{"state"|"param_groups": {parameter name: {key: value}}}`` from ``<section>.<name>.<key>`` entries."""
    split: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
    for flat_key, value in entries.items():
        section, _, rest = flat_key.partition(".")
        parts = rest.split(".")
        name = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in names), None)
        if section not in split or name is None:
            raise ValueError(f"{where}: entry {flat_key!r} belongs to no parameter of the recorded param groups; "
                             "the checkpoint and its recorded order disagree.")
        split[section].setdefault(name, {})[".".join(parts[len(name.split(".")):])] = value
    return split


def index_keyed_optimizer_state(
    entries: dict[str, Any], groups: list[list[str]], where: str, tied_copies: Sequence[str] = ()
) -> dict[str, Any]:
    """One optimizer's flattened, name-keyed DCP state as ``Optimizer.state_dict()`` gives it.

    Args:
        entries: the optimizer's DCP entries without the ``optimizer_<i>.`` prefix
            (``state.<name>.<key>`` and ``param_groups.<name>.<key>``).
        groups: the parameter names of each param group, in ``configure_optimizers`` order.
        where: names the optimizer in errors.
        tied_copies: names whose entries are dropped (copies of a tied parameter; one parameter unsplit).

    Raises:
        ValueError: entries outside the groups, or parameters of one group with different settings.
    """
    split = _by_parameter(entries, {n for names in groups for n in names} | set(tied_copies), where)
    state, param_groups, index = {}, [], 0
    for names in groups:
        settings = [split["param_groups"].get(name) for name in names]
        if not settings or None in settings or any(s != settings[0] for s in settings):
            raise ValueError(f"{where}: the parameters of one param group ({names[:3]}...) have different or no "
                             "settings in the checkpoint; the checkpoint and its recorded order disagree.")
        param_groups.append({**settings[0], "params": list(range(index, index + len(names)))})
        for name in names:
            if name in split["state"]:  # a parameter that never had a gradient has no state, as in torch
                state[index] = _nest(split["state"][name])
            index += 1
    return {"state": state, "param_groups": param_groups}


def _recorded_order(meta: dict[str, Any], optimizers: int, checkpoint: Path) -> list[list[list[str]]]:
    order = (meta.get("lightning_parallel") or {}).get(ORDER_KEY)
    if order is None or len(order) != optimizers:
        why = ("its strategy could not recover the order (a pipeline-split optimizer whose groups do not list "
               "parameters in module order)" if "lightning_parallel" in meta and ORDER_KEY in meta["lightning_parallel"]
               else "it was written without the order (an older lightning_parallel, or another writer)")
        raise ValueError(
            f"{checkpoint} holds optimizer state by parameter name, but a Lightning checkpoint needs it by index in "
            f"configure_optimizers order, and {why}. Convert with --no-optimizer for weights and training state "
            "only, or resume it under a lightning_parallel strategy and save it again."
        )
    return order


def _optimizer_state(checkpoint: Path, index: int, meta: dict[str, Any], count: int) -> tuple[dict[str, Any], list]:
    """One optimizer's index-keyed state and the names of its param groups: Lightning DCP folders nest param groups
    listing names in order (used as they are); the suite's flattened groups take the order its strategies recorded."""
    key = f"optimizer_{index}"
    entries = _read_entries(checkpoint, f"{key}.")
    nested = nested_param_groups({f"{key}.{k}": v for k, v in entries.items()}, key)
    if nested is not None:
        entries = {k: v for k, v in entries.items() if not k.startswith("param_groups.")}
        entries.update(flatten_nested_groups(nested))
        groups = [list(group["params"]) for group in nested]
        return index_keyed_optimizer_state(entries, groups, key), groups
    tied = (meta.get("lightning_parallel") or {}).get(TIED_KEY, ())
    groups = _recorded_order(meta, count, checkpoint)[index]
    return index_keyed_optimizer_state(entries, groups, key, tied), groups


def recorded_entry(groups: list[list[list[str]]]) -> dict[str, Any]:
    """The ``lightning_parallel`` entry of a Lightning file written here: the names of each param group only.

    Lightning's ``fit(ckpt_path=...)`` ignores it; converting the file again reads its positions by
    these names instead of inferring them (see :func:`~.reader.optimizer_group_names`).
    """
    return {ORDER_KEY: groups}


def to_lightning_checkpoint(
    checkpoint: Path, optimizer_state: bool = True, weights_only: Optional[bool] = None
) -> dict[str, Any]:
    """The whole checkpoint dict ``trainer.save_checkpoint`` writes under Lightning's single-device/DDP strategies.

    Args:
        checkpoint: a suite checkpoint folder (any layout), or a Lightning DCP folder
            (``ModelParallelStrategy``, ``FSDPStrategy`` sharded: their param groups name the parameters in order).
        optimizer_state: ``False`` leaves ``optimizer_states`` out (Lightning's ``fit(ckpt_path=...)``
            then refuses the file; ``load_from_checkpoint`` and ``validate``/``test`` take it).
        weights_only: ``False`` unpickles any object in ``meta.pt`` (a folder you trust).

    Raises:
        ValueError: not a DCP checkpoint folder, or suite optimizer state whose order was not recorded.
    """
    checkpoint = resolve_checkpoint(Path(checkpoint))
    if not is_sharded_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a DCP checkpoint folder (no .metadata and meta.pt inside).")
    meta = load_plain(checkpoint / METADATA_FILE, weights_only=weights_only is not False)
    metadata = SafeFileSystemReader(checkpoint).read_metadata().state_dict_metadata
    model_key = next((k for k in MODEL_KEYS if any(e.startswith(f"{k}.") for e in metadata)), MODEL_KEYS[0])
    result = {key: plain_containers(value) for key, value in meta.items() if key not in _SUITE_ONLY}
    result["state_dict"] = _read_entries(checkpoint, f"{model_key}.")
    if not optimizer_state:
        return result
    count = len({key.split(".", 1)[0] for key in metadata if key.startswith("optimizer_")})
    states = [_optimizer_state(checkpoint, i, meta, count) for i in range(count)]
    result["optimizer_states"] = [state for state, _ in states]
    result["lightning_parallel"] = recorded_entry([groups for _, groups in states])
    return result


def rewrite_single_file(
    path: Path, out: Path, optimizer_state: bool = True, weights_only: Optional[bool] = None
) -> Path:
    """A Lightning single file written again, loadable by Lightning's own ``torch.load(weights_only=True)``.

    Everything is kept as saved (the optimizer state by position too) but OmegaConf hyper-parameters,
    which become plain dicts and lists: torch >= 2.6 refuses them when Lightning's ``fit(ckpt_path=...)``
    loads the file as it does by default.

    Args:
        path: the ``.ckpt`` file, read through the allow-list (:func:`~.reader.load_single_file`).
        out: the file to write (a hidden temporary name, then a rename).
        optimizer_state: ``False`` leaves ``optimizer_states`` out.
        weights_only: ``False`` only for a file the user trusts (objects beyond plain values).
    """
    checkpoint = load_single_file(Path(path), weights_only)
    if not optimizer_state:
        checkpoint.pop("optimizer_states", None)
    return write_state_dict(plain_containers(checkpoint), Path(out))


def convert_to_lightning(
    checkpoint: Path, out: Path, optimizer_state: bool = True, weights_only: Optional[bool] = None
) -> Path:
    """Write :func:`to_lightning_checkpoint` as one file (a hidden temporary name, then a rename).

    Args:
        checkpoint: a suite checkpoint folder.
        out: the ``.ckpt`` file to write; ``Trainer(strategy="auto"|"ddp").fit(model, ckpt_path=out)``.
        optimizer_state: see :func:`to_lightning_checkpoint`.
        weights_only: see :func:`to_lightning_checkpoint`.

    Returns:
        The path written.
    """
    return write_state_dict(to_lightning_checkpoint(checkpoint, optimizer_state, weights_only), Path(out))
