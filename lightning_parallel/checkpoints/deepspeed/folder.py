"""Reading a DeepSpeed checkpoint folder: where it is, its weights and Lightning's state in it.

``trainer.save_checkpoint(path)`` under
:class:`~lightning_parallel.strategies.deepspeed.strategy.DeepSpeedDataParallelStrategy` writes a *folder*:
``path/latest`` names a tag (``checkpoint``), and ``path/checkpoint/``
holds the model-state file(s) -- which also carry Lightning's own state (loops, global
step, schedulers, callbacks) -- and one optimizer-state shard per rank. Under ZeRO 1-3 the
fp32 weights and the optimizer state (Adam's moments, SGD's momentum) live there as flat
per-rank partitions, so no single file holds the model. The optimizer state is read by
:mod:`~lightning_parallel.checkpoints.deepspeed.optimizer`.

Reading needs DeepSpeed installed (for ZeRO 1-3). Every file is unpickled through an allow-list: tensors,
plain values, OmegaConf containers and the few DeepSpeed classes its files hold
(:func:`~lightning_parallel.checkpoints.safe_loading.load_deepspeed_file`); DeepSpeed's own ``zero_to_fp32``
reads them with ``weights_only=False``, so the folder is checked file by file first. A tampered file is
refused with :class:`~lightning_parallel.checkpoints.safe_loading.CheckpointRefused`; ``weights_only=False``
reads a folder the user trusts without the allow-list.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel.checkpoints.safe_loading import check_deepspeed_folder, load_deepspeed_file

PathLike = str | os.PathLike
# Lightning wrapped modules under this name in older versions; weights saved then carry it.
_WRAPPER_PREFIX = "_forward_module."
MODEL_STATES = "mp_rank_00_model_states.pt"
# Keys DeepSpeed's engine writes into the model-state file (DeepSpeedEngine's _common_checkpoint_state
# and _save_zero_checkpoint in 0.19.8); everything else in it is Lightning's client_state.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers", "autoep_layers", "folding_metadata",
})
# Keys Lightning always writes; their absence means the folder was not written by trainer.save_checkpoint.
_LIGHTNING_KEYS = ("epoch", "global_step", "loops")


def is_deepspeed_folder(path: Path) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint: the top folder (``latest``, tag folders) or a tag folder.

    Args:
        path: any path.
    """
    return path.is_dir() and (
        (path / "latest").is_file() or any(path.glob("*_model_states.pt")) or any(path.glob("*/*_model_states.pt"))
    )


def resolve_folder(checkpoint_dir: PathLike, tag: str | None) -> tuple[Path, str]:
    """The top-level folder and tag of a checkpoint given as the top folder or the tag folder.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.

    Raises:
        ValueError: no such folder, no ``latest`` file without ``tag``, or no such tag.
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is not a DeepSpeed checkpoint folder: pass the folder trainer.save_checkpoint wrote "
            "(it contains a 'latest' file and a 'checkpoint' folder)."
        )
    if tag is None and not (path / "latest").is_file() and any(path.glob("*_model_states.pt")):
        return path.parent, path.name  # the tag folder itself was given
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise ValueError(
                f"{str(path)!r} has no 'latest' file naming the checkpoint tag: pass tag= (--tag) or the tag folder."
            )
        tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise ValueError(f"Tag folder {str(path / tag)!r} does not exist: check tag= (--tag).")
    return path, tag


def check_deepspeed_checkpoint(
    checkpoint_dir: PathLike, weights_only: Optional[bool] = None, tag: str | None = None
) -> None:
    """Refuse a DeepSpeed checkpoint any of whose files holds objects beyond the allow-list, before DeepSpeed reads it.

    For readers that hand the folder to DeepSpeed itself (``engine.load_checkpoint``, ``zero_to_fp32``), which
    unpickle every file with ``weights_only=False``.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        weights_only: ``False``: the user trusts the folder (``Trainer.fit(..., weights_only=False)``): no check.
        tag: the tag to check; default: the one named in ``latest`` (the one DeepSpeed loads).

    Raises:
        CheckpointRefused: a file holds other objects (see
            :func:`~lightning_parallel.checkpoints.safe_loading.check_deepspeed_folder`).
        ValueError: not a DeepSpeed checkpoint folder.
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    check_deepspeed_folder(top / tag, weights_only)


def has_zero_shards(tag_dir: Path) -> bool:
    """Whether a tag folder holds ZeRO 1-3 optimizer shards (stage 0 writes none)."""
    return any(tag_dir.glob("*_optim_states.pt"))


def strip_wrapper(name: str) -> str:
    """A parameter name without the prefix older Lightning versions saved wrapped modules under."""
    return name.removeprefix(_WRAPPER_PREFIX)


def first_model_states(tag_dir: Path) -> Path:
    """The model-state file Lightning's state is read from (ZeRO-3 writes one per rank, all alike)."""
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise ValueError(f"{str(tag_dir)!r} holds no *model_states.pt file: not a DeepSpeed checkpoint.")
    return (tag_dir / MODEL_STATES) if (tag_dir / MODEL_STATES).is_file() else files[0]


def consolidate_state_dict(
    checkpoint_dir: PathLike, tag: str | None = None, weights_only: Optional[bool] = None
) -> OrderedDict[str, torch.Tensor]:
    """Gather a DeepSpeed checkpoint's weights into one fp32 ``state_dict`` on the CPU.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.
        weights_only: ``False`` unpickles any object (a folder you trust); see the module docstring.

    Returns:
        Parameter (and buffer) names of the LightningModule mapped to full fp32 CPU tensors,
        ready for ``module.load_state_dict``.

    Raises:
        ValueError: the folder is not a DeepSpeed checkpoint.
        CheckpointRefused: a file holds objects beyond the allow-list.

    Note:
        ZeRO 1-3 keep the fp32 master weights in per-rank optimizer shards, which
        ``deepspeed.utils.zero_to_fp32`` knows how to stitch together (any world size).
        ZeRO stage 0 writes no shards: its full weights are in the model-state file.
        ``zero_to_fp32`` returns buffers first, then parameters param group by param group; the
        names are put back in the module's order (the model-state file's ``module``), the order
        ``module.state_dict()`` and Lightning's own files have, which the param groups of a
        Lightning file written from them are read against.
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    tag_dir = top / tag
    first = load_deepspeed_file(first_model_states(tag_dir), weights_only)
    module_order = [strip_wrapper(name) for name in first.get("module") or ()]
    if has_zero_shards(tag_dir):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        check_deepspeed_folder(tag_dir, weights_only)  # zero_to_fp32 unpickles with weights_only=False
        # Silenced: it prints a line per step and progress bars (exceptions still propagate).
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(top), tag=tag)
    else:
        model_file = tag_dir / MODEL_STATES
        if not model_file.is_file():
            raise ValueError(
                f"{str(tag_dir)!r} holds neither ZeRO shards nor {MODEL_STATES}: not a DeepSpeed checkpoint."
            )
        state = load_deepspeed_file(model_file, weights_only)["module"]
    consolidated: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        consolidated[strip_wrapper(name)] = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
    position = {name: index for index, name in enumerate(module_order)}
    return OrderedDict(sorted(consolidated.items(), key=lambda item: position.get(item[0], len(position))))


def read_lightning_state(
    checkpoint_dir: PathLike, tag: str | None = None, weights_only: Optional[bool] = None
) -> dict[str, Any]:
    """Lightning's own checkpoint entries (epoch, global step, loops, schedulers, callbacks, hparams).

    Lightning hands them to DeepSpeed as ``client_state``, which stores them beside its own
    keys in the model-state file; this returns them without DeepSpeed's.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.
        weights_only: ``False`` unpickles any object (a folder you trust).

    Raises:
        ValueError: the folder is not a DeepSpeed checkpoint, or was not written by Lightning
            (:class:`~lightning_parallel.checkpoints.safe_loading.CheckpointRefused`: objects beyond the allow-list).
    """
    top, tag = resolve_folder(checkpoint_dir, tag)
    return lightning_entries(load_deepspeed_file(first_model_states(top / tag), weights_only), top / tag)


def lightning_entries(model_state: dict[str, Any], where: Path) -> dict[str, Any]:
    """Lightning's entries of a loaded model-state file (all but DeepSpeed's own keys).

    Args:
        model_state: the loaded ``*model_states.pt``.
        where: the tag folder, for the error message.

    Raises:
        ValueError: Lightning's keys are missing (the folder was not written by ``trainer.save_checkpoint``).
    """
    missing = [key for key in _LIGHTNING_KEYS if key not in model_state]
    if missing:
        raise ValueError(
            f"{str(where)!r} lacks Lightning's {missing}: it was not written by trainer.save_checkpoint, so there "
            "is no training progress to resume. Convert the weights only (OUT.pt / convert_checkpoint)."
        )
    return {key: value for key, value in model_state.items() if key not in _DEEPSPEED_KEYS}
