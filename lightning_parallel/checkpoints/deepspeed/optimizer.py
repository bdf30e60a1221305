"""A DeepSpeed checkpoint's optimizer state, gathered per parameter name.

Under ZeRO 1-3 the wrapped torch optimizer steps on each rank's flat fp32 partition, so its
state (Adam's moments, SGD's momentum) is saved as flat per-rank partitions too; stage 0
saves a plain torch optimizer ``state_dict`` indexed by position. Both are turned into
torch's optimizer ``state_dict`` with parameter names in place of indices.
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel._compat import zero_merge_trainable_params
from lightning_parallel.checkpoints.deepspeed.folder import (
    MODEL_STATES,
    PathLike,
    has_zero_shards,
    resolve_folder,
    strip_wrapper,
)
from lightning_parallel.checkpoints.lightning.reader import name_positions
from lightning_parallel.checkpoints.safe_loading import check_deepspeed_folder, load_deepspeed_file


def _world_size(shard: dict[str, Any]) -> int:
    count = shard["partition_count"]
    # ZeRO-1/2 store one count per param group (expert groups may differ): the largest is the DP size.
    return max(count) if isinstance(count, (list, tuple)) else int(count)


def _merge_flat(
    stage: int, world_size: int, flat_per_rank: list[list[torch.Tensor]], model_states: list, paddings: Any
) -> dict[str, torch.Tensor]:
    """Full per-parameter tensors from per-rank flat partitions laid out like the fp32 master weights.

    Note:
        The wrapped torch optimizer steps on the flat fp32 partition itself, so every
        element-wise state tensor (``exp_avg``, ``momentum_buffer``, ...) has exactly that
        partition's layout, paddings included. ``zero_to_fp32``'s reconstruction of the
        weights is therefore reused as is, with the state tensors in place of the weights
        (its merge functions are private, reached through ``_compat``; the tests pin them to
        the live DeepSpeed state). ``ds_to_universal`` was the other candidate: it hard-codes
        Adam's two moments (SGD fails with KeyError 'exp_avg'), leaves ZeRO-3 tensors flat
        without ``step``, needs state Lightning does not save, and goes through a temporary
        file per fragment.
    """
    merged: OrderedDict[str, Any] = OrderedDict()
    # Silenced: a summary line per call and a progress bar titled "weights" for every state key.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        zero_merge_trainable_params(stage, merged, world_size, flat_per_rank, model_states, paddings)
    return {strip_wrapper(name): tensor.contiguous().clone() for name, tensor in merged.items()}


def _unsupported(key: str, why: str) -> ValueError:
    return ValueError(
        f"Optimizer state {key!r} {why}: only element-wise state tensors (Adam/AdamW exp_avg, exp_avg_sq, SGD "
        "momentum_buffer, ...) and per-group scalars (step) can be re-split per parameter. Convert the weights only "
        "(OUT.pt, or --no-optimizer for a DCP folder whose optimizer starts afresh)."
    )


def _split_key(key: str, values: list[list[Any]], partitions: list[list[torch.Tensor]]) -> str:
    """How one optimizer state key is laid out: ``"flat"`` like the fp32 partitions, or one ``"scalar"`` per partition.

    Args:
        key: the state key (``exp_avg``, ``step``, ...).
        values: ``values[rank][i]``: the key's value for flat partition ``i`` of that rank.
        partitions: ``partitions[rank][i]``: the fp32 master-weight partition it belongs to.
    """
    pairs = [(v, p) for rank_values, rank_parts in zip(values, partitions) for v, p in zip(rank_values, rank_parts)]
    if all(torch.is_tensor(v) and v.dim() == 1 and v.numel() == p.numel() for v, p in pairs):
        return "flat"
    if all(v is not None and (not torch.is_tensor(v) or v.dim() == 0) for v, _ in pairs):
        if any(float(v) != float(first) for rank_values in values for v, first in zip(rank_values, values[0])):
            raise _unsupported(key, "differs between ranks")
        return "scalar"
    raise _unsupported(key, "is neither laid out like the flat fp32 partition nor a scalar")


def _without_group_padding(
    values: list[list[Any]], partitions: list[list[torch.Tensor]], paddings: list[list[int]]
) -> list[list[Any]]:
    """ZeRO 1/2 element-wise state cut to the length of the saved fp32 partitions.

    Args:
        values: ``values[rank][i]``: one state key's value for flat partition ``i`` of that rank.
        partitions: ``partitions[rank][i]``: the saved fp32 master-weight partition.
        paddings: ``paddings[rank][i]``: the shard's ``group_paddings``, elements of alignment padding.

    Note:
        ZeRO 1/2 pad each param group's flat buffer to a multiple of 2 x the data-parallel size; the
        padding ends the last rank's partition (or the last ranks'), ``group_paddings[i]`` elements on
        each. ``state_dict`` saves the fp32 partitions without it but the wrapped torch optimizer's state
        (SGD's ``momentum_buffer``, Adam's moments) with it, so there each element-wise tensor is longer
        by exactly that padding, which no parameter reads. Cutting it off is what DeepSpeed's own
        ``_get_state_without_padding`` does for elastic checkpoints. ZeRO-3 saves both with padding.
    """
    return [
        [v[: p.numel()] if pad and torch.is_tensor(v) and v.dim() == 1 and v.numel() == p.numel() + pad else v
         for v, p, pad in zip(rank_values, rank_parts, rank_pads)]
        for rank_values, rank_parts, rank_pads in zip(values, partitions, paddings)
    ]


def _read_zero_shards(
    tag_dir: Path, weights_only: Optional[bool]
) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """The ZeRO stage, each rank's ZeRO optimizer state and each rank's wrapped torch optimizer state."""
    from deepspeed.utils import zero_to_fp32

    files = zero_to_fp32.get_optim_files(str(tag_dir))
    shards = [load_deepspeed_file(Path(f), weights_only)["optimizer_state_dict"] for f in files]
    stage, world_size = int(shards[0]["zero_stage"]), _world_size(shards[0])
    if world_size != len(shards):
        raise ValueError(
            f"{str(tag_dir)!r} holds {len(shards)} optimizer shards for {world_size} ranks: the checkpoint is "
            "incomplete (a rank failed to save?)."
        )
    inner = [shard["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"] for shard in shards]
    if "param_groups" not in inner[0]:  # elastic checkpoints keep a list of per-group states instead
        raise ValueError(
            "This ZeRO checkpoint was saved with zero_optimization.elastic_checkpoint=true, which drops the param "
            "groups: save it again with elastic_checkpoint false (the default)."
        )
    return stage, shards, inner


def _zero_optimizer_state(tag_dir: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """The optimizer state of a ZeRO 1-3 checkpoint per parameter (see :func:`consolidate_optimizer_state`)."""
    from deepspeed.utils import zero_to_fp32

    check_deepspeed_folder(tag_dir, weights_only)  # parse_model_states unpickles with weights_only=False
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tag_dir)))
    stage, shards, inner = _read_zero_shards(tag_dir, weights_only)
    groups = inner[0]["param_groups"]
    order = [index for group in groups for index in group["params"]]  # inner state index of each flat partition
    names = [[strip_wrapper(n) for n in shapes] for shapes in model_states[0].param_shapes]  # the parameters in each
    if len(order) != len(names) or not all(index in inner[0]["state"] for index in order):
        raise ValueError(
            f"{str(tag_dir)!r}: {len(order)} optimizer partitions for {len(names)} parameter groups, or a partition "
            "with no state (saved before the first optimizer step?): cannot map the optimizer state to parameters."
        )
    fp32 = [shard["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for shard in shards]
    group_paddings = [shard.get("group_paddings") or [0] * len(order) for shard in shards]  # ZeRO 1/2
    state: dict[str, dict[str, Any]] = {name: {} for flat in names for name in flat}
    for key in inner[0]["state"][order[0]]:
        values = [[rank["state"][index].get(key) for index in order] for rank in inner]
        if stage <= 2:
            values = _without_group_padding(values, fp32, group_paddings)
        if _split_key(key, values, fp32) == "flat":
            paddings = shards[0].get("param_alignment_paddings")
            for name, tensor in _merge_flat(stage, len(shards), values, model_states, paddings).items():
                state[name][key] = tensor
        else:  # a per-group scalar such as Adam's step: every parameter of the partition gets a copy
            for value, flat in zip(values[0], names):
                for name in flat:
                    state[name][key] = value.detach().clone() if torch.is_tensor(value) else value
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"},
         "params": [name for index in group["params"] for name in names[order.index(index)]]}
        for group in groups
    ]
    return {"state": state, "param_groups": param_groups}


def _stage0_optimizer_state(
    tag_dir: Path, group_names: Optional[Sequence[Sequence[str]]], weights_only: Optional[bool]
) -> dict[str, Any]:
    """The optimizer state of a ZeRO stage 0 checkpoint: a plain torch optimizer state_dict, indexed by position.

    Note:
        Stage 0 saves the optimizer unsharded but with parameter *indices*, not names, as
        Lightning's single files do: they are named the same way (``group_names``, or inferred
        from the parameters' order and the state's shapes by
        :func:`~lightning_parallel.checkpoints.lightning.reader.name_positions`, refused when unclear).
    """
    model_state = load_deepspeed_file(tag_dir / MODEL_STATES, weights_only)
    saved = model_state.get("optimizer")
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        raise ValueError(
            f"{str(tag_dir)!r} holds no torch optimizer state (ZeRO stage 0 with fp16/bf16?): convert the weights only."
        )
    buffers = set(model_state.get("buffer_names") or ())
    module = {strip_wrapper(n): t for n, t in model_state["module"].items() if n not in buffers}
    named = name_positions(saved, module, group_names)
    named["state"] = {name: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                      for name, entry in named["state"].items()}
    return named


def consolidate_optimizer_state(
    checkpoint_dir: PathLike,
    tag: str | None = None,
    group_names: Optional[Sequence[Sequence[str]]] = None,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Gather a DeepSpeed checkpoint's optimizer state into one dict keyed by parameter name.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.
        group_names: ZeRO stage 0 only (ZeRO 1-3 record the names): the parameter names of each
            param group in ``configure_optimizers`` order; default: inferred (see ``_stage0_optimizer_state``).
        weights_only: ``False`` unpickles any object (a folder you trust); by default the allow-list of
            :func:`~lightning_parallel.checkpoints.safe_loading.load_deepspeed_file`.

    Returns:
        ``{"state": {name: {"exp_avg": full tensor, "step": tensor, ...}}, "param_groups":
        [{"lr": ..., ..., "params": [names]}]}`` -- torch's optimizer ``state_dict`` with names
        in place of indices (the form ``get_optimizer_state_dict`` returns), on the CPU.

    Raises:
        ValueError: not a DeepSpeed checkpoint, or optimizer state that is not element-wise
            or scalar per parameter (say, factored second moments), which cannot be re-split.
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    tag_dir = top / tag
    if has_zero_shards(tag_dir):
        return _zero_optimizer_state(tag_dir, weights_only)
    return _stage0_optimizer_state(tag_dir, group_names, weights_only)
