"""A DeepSpeed checkpoint folder converted: to one plain ``state_dict`` file, the suite's DCP folder, a Lightning file.

Every conversion runs on one process with no process group (``lp-convert ZERO_DIR OUT.pt``,
``lp-convert ZERO_DIR OUT.ckpt``, ``lp-convert ZERO_DIR x.ckpt --to lightning``):

- :func:`convert_checkpoint` writes the weights as one ``torch.save`` file (loads with
  ``model.load_state_dict(torch.load(file))`` anywhere, without DeepSpeed).
- :func:`convert_to_dcp` writes the folder format of :mod:`lightning_parallel.checkpoints.dcp`
  -- weights, the optimizer state per parameter and Lightning's state -- so
  ``Trainer(strategy=HybridParallelStrategy(...)).fit(model, ckpt_path=OUT)`` (or
  ``pipeline_parallel``/``tensor_parallel``, any world size) *resumes* the DeepSpeed run:
  same losses as if it had continued under DeepSpeed.
- :func:`as_lightning_checkpoint` gives what ``trainer.save_checkpoint`` writes under Lightning's
  single-device and DDP strategies, which resume it with ``fit(ckpt_path=...)``.

Reading needs DeepSpeed installed (ZeRO 1-3) and unpickles its files through an allow-list (tensors, plain
values, OmegaConf containers, the DeepSpeed classes its files hold: see
:mod:`~lightning_parallel.checkpoints.deepspeed.folder`); ``weights_only=False`` reads a folder you trust
without it. The outputs do not need DeepSpeed, and the DCP folder is read by the suite's allow-listed loader.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.checkpoints.dcp import save_on_one_process
from lightning_parallel.checkpoints.deepspeed.folder import (
    PathLike,
    consolidate_state_dict,
    first_model_states,
    lightning_entries,
    resolve_folder,
)
from lightning_parallel.checkpoints.deepspeed.optimizer import consolidate_optimizer_state
from lightning_parallel.checkpoints.lightning.groups import PositionsUnknown
from lightning_parallel.checkpoints.lightning.reader import ORDER_KEY, flatten_optimizer_state
from lightning_parallel.checkpoints.lightning.writer import index_keyed_optimizer_state, recorded_entry
from lightning_parallel.checkpoints.pt import write_state_dict
from lightning_parallel.checkpoints.safe_loading import load_deepspeed_file, plain_containers


def _child(module: nn.Module, name: str) -> nn.Module:
    """``module``'s submodule ``name``, added empty first if it has none by that name."""
    if name not in dict(module.named_children()):
        module.add_module(name, nn.Module())
    return module.get_submodule(name)


def _stand_in_module(weights: dict[str, torch.Tensor], parameters: set[str]) -> nn.Module:
    """An empty module tree holding ``weights`` under their names (parameters as ``nn.Parameter``)."""
    root = nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            module = _child(module, part)
        if name in parameters:
            module.register_parameter(leaf, nn.Parameter(tensor))
        else:
            module.register_buffer(leaf, tensor)
    return root


def _flattened_optimizer_state(weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state in the flattened DCP form the suite's loader expects (``state.<name>.exp_avg``, ...).

    Note:
        The flattened form is produced by torch's own ``get_optimizer_state_dict`` -- the call
        the suite's strategies save with and its loader builds the expected keys from -- on a
        stand-in module and optimizer holding the gathered state, so the key format stays
        torch's, not a copy of it. The base ``Optimizer`` class suffices: only ``state_dict``
        is called, never ``step``, and the state is never empty (torch would then take a step).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    names = {name for group in optimizer_state["param_groups"] for name in group["params"]}
    unknown = sorted(names - weights.keys())
    if unknown:
        raise ValueError(
            f"Optimizer state names parameters the weights lack ({unknown[:3]}...): the checkpoint is inconsistent."
        )
    module = _stand_in_module(weights, names)
    params = dict(module.named_parameters(remove_duplicate=False))
    groups = [{**group, "params": [params[n] for n in group["params"]]} for group in optimizer_state["param_groups"]]
    optimizer = torch.optim.Optimizer(groups, defaults={})
    for name, entry in optimizer_state["state"].items():
        optimizer.state[params[name]] = entry
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def _fresh(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The same state keys, zeroed: what an optimizer that never stepped would hold (step 0, zero moments)."""
    zeroed = {name: {k: torch.zeros_like(v) if torch.is_tensor(v) else type(v)(0) for k, v in entry.items()}
              for name, entry in optimizer_state["state"].items()}
    return {"state": zeroed, "param_groups": optimizer_state["param_groups"]}


def _source_entry(
    model_state: dict[str, Any], optimizer_state: bool, groups: Optional[list[list[str]]]
) -> dict[str, Any]:
    """The ``lightning_parallel`` entry of ``meta.pt``: the fields the suite's strategies write, plus the source.

    ``groups`` (the names of each param group, in order) is recorded as the strategies record it, so
    the folder converts on to a Lightning file (``lp-convert OUT x.ckpt --to lightning``).
    """
    stage = int((model_state.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    source = f"deepspeed {model_state.get('ds_version', '?')} ZeRO-{stage}"
    return {
        "layout": (int(model_state.get("dp_world_size", 1)), 1, 1),  # (data, pipeline, tensor) of the DeepSpeed run
        "zero_stage": stage,
        "schedule": None,
        "source": source if optimizer_state else f"{source}, optimizer reset",
        ORDER_KEY: None if groups is None else [groups],
    }


def convert_to_dcp(
    checkpoint_dir: PathLike,
    output_dir: PathLike,
    tag: str | None = None,
    optimizer_state: bool = True,
    group_names: Optional[Sequence[Sequence[str]]] = None,
    weights_only: Optional[bool] = None,
) -> Path:
    """Write a DeepSpeed checkpoint as the suite's DCP folder, so another layout resumes the run.

    The folder holds ``{"state_dict": weights, "optimizer_0": flattened optimizer state}`` as
    DCP shards plus ``meta.pt`` (Lightning's state and a ``lightning_parallel`` entry naming
    the source), exactly what :class:`~lightning_parallel.strategies.HybridParallelStrategy`
    and its presets save; ``Trainer(...).fit(model, ckpt_path=output_dir)`` resumes from it
    under any of their layouts and world sizes. It is built in the hidden folder
    ``.<name>.partial`` and renamed into place when complete.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        output_dir: the folder to write (e.g. ``converted.ckpt``); an existing one is replaced.
        tag: the tag to read; default: the one named in ``latest``.
        optimizer_state: carry the optimizer state over (default). ``False`` writes the same
            keys zeroed (step 0), so the resumed run restarts the optimizer as a new one would
            (none at all where ZeRO-0 positions cannot be named).
        group_names: ZeRO stage 0 only: the names of each param group (see ``consolidate_optimizer_state``).
        weights_only: ``False`` unpickles any object (a folder you trust); by default the allow-list.

    Returns:
        The folder written.

    Raises:
        ValueError: not a DeepSpeed checkpoint written by Lightning, or an optimizer state
            that cannot be re-split per parameter (see ``consolidate_optimizer_state``).

    Note:
        Runs on one process: DCP saves with ``no_dist=True``, so it also works from a single
        rank of a running job without turning into a collective.
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    model_state = load_deepspeed_file(first_model_states(top / tag), weights_only)
    metadata = lightning_entries(model_state, top / tag)
    weights = consolidate_state_dict(top, tag, weights_only)
    gathered = _named_optimizer_state(top, tag, group_names, optimizer_state, weights_only)
    groups = None if gathered is None else [list(group["params"]) for group in gathered["param_groups"]]
    metadata["lightning_parallel"] = _source_entry(model_state, optimizer_state, groups)
    state = {"state_dict": weights}
    if gathered is not None:
        state["optimizer_0"] = _flattened_optimizer_state(weights, gathered if optimizer_state else _fresh(gathered))
    return save_on_one_process(Path(output_dir), state, metadata)


def _named_optimizer_state(
    top: Path, tag: str, group_names: Optional[Sequence[Sequence[str]]], optimizer_state: bool,
    weights_only: Optional[bool],
) -> Optional[dict[str, Any]]:
    """:func:`consolidate_optimizer_state`, or None where no state is asked for and ZeRO-0 positions have no names
    (without names there are no keys to zero: the state is left out, as for a Lightning source)."""
    try:
        return consolidate_optimizer_state(top, tag, group_names, weights_only)
    except PositionsUnknown:
        if optimizer_state:
            raise
        return None


def as_lightning_checkpoint(
    checkpoint_dir: PathLike,
    tag: str | None = None,
    optimizer_state: bool = True,
    group_names: Optional[Sequence[Sequence[str]]] = None,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """A DeepSpeed checkpoint as the dict Lightning's single-device and DDP strategies write (save_checkpoint).

    Weights in full, Lightning's own entries (loops, callbacks, schedulers, hyper-parameters as plain
    containers) and, unless ``optimizer_state`` is False, the optimizer state keyed by position in
    ``configure_optimizers`` order: DeepSpeed records the parameters of each param group by name in
    that order (ZeRO 1-3), ZeRO 0 by position (named as in :func:`consolidate_optimizer_state`).

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.
        optimizer_state: ``False`` leaves ``optimizer_states`` out (weights and training state only).
        group_names: ZeRO stage 0 only: the names of each param group.
        weights_only: ``False`` unpickles any object (a folder you trust); by default the allow-list.

    Raises:
        ValueError: not a DeepSpeed checkpoint written by Lightning, or optimizer state that cannot be
            re-split per parameter or named.
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    metadata = lightning_entries(load_deepspeed_file(first_model_states(top / tag), weights_only), top / tag)
    result = {key: plain_containers(value) for key, value in metadata.items() if key != "lightning_parallel"}
    result["state_dict"] = consolidate_state_dict(top, tag, weights_only)
    if optimizer_state:
        named = consolidate_optimizer_state(top, tag, group_names, weights_only)
        groups = [list(group["params"]) for group in named["param_groups"]]
        state = index_keyed_optimizer_state(flatten_optimizer_state(named), groups, "optimizer_0")
        result["optimizer_states"] = [state]
        result["lightning_parallel"] = recorded_entry([groups])
    return result


def convert_checkpoint(
    checkpoint_dir: PathLike, output_file: PathLike, tag: str | None = None, weights_only: Optional[bool] = None
) -> Path:
    """Write a DeepSpeed checkpoint's weights as one ``torch.save`` file of a plain ``state_dict``.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        output_file: the file to write (its folder is created); written to a temporary
            name first and renamed, so a failed run never leaves a half-written file.
        tag: the tag to read; default: the one named in ``latest``.
        weights_only: ``False`` unpickles any object (a folder you trust); by default the allow-list.

    Returns:
        The path written.
    """
    return write_state_dict(consolidate_state_dict(checkpoint_dir, tag, weights_only), Path(output_file))
