"""Convert a DeepSpeed checkpoint folder: to one plain ``state_dict`` file, or to the suite's DCP format.

``trainer.save_checkpoint(path)`` under :class:`~lightning_parallel.strategies.deepspeed.DeepSpeedDataParallelStrategy`
writes a *folder*: ``path/latest`` names a tag (``checkpoint``), and ``path/checkpoint/``
holds the model-state file(s) -- which also carry Lightning's own state (loops, global
step, schedulers, callbacks) -- and one optimizer-state shard per rank. Under ZeRO 1-3 the
fp32 weights and the optimizer state (Adam's moments, SGD's momentum) live there as flat
per-rank partitions, so no single file holds the model.

Two conversions, both on one process with no process group::

    python -m lightning_parallel.parallel.deepspeed_checkpoint CKPT_DIR OUT.pt    # weights only
    python -m lightning_parallel.parallel.deepspeed_checkpoint CKPT_DIR OUT.ckpt  # resumable DCP folder

- :func:`convert_checkpoint` writes the weights as one ``torch.save`` file (loads with
  ``model.load_state_dict(torch.load(file))`` anywhere, without DeepSpeed).
- :func:`convert_to_dcp` writes the folder format of
  :mod:`lightning_parallel.parallel.checkpoint` -- weights, the optimizer state per parameter
  and Lightning's state -- so ``Trainer(strategy=HybridParallelStrategy(...)).fit(model,
  ckpt_path=OUT)`` (or ``pipeline_parallel``/``tensor_parallel``, any world size) *resumes*
  the DeepSpeed run: same losses as if it had continued under DeepSpeed.

Reading needs DeepSpeed installed and unpickles its files with ``weights_only=False``
(they hold DeepSpeed objects): convert only checkpoints you trust. The outputs do not need
DeepSpeed, and the DCP folder is read by the suite's allow-listed loader.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

_PathLike = str | os.PathLike
# Lightning wrapped modules under this name in older versions; weights saved then carry it.
_WRAPPER_PREFIX = "_forward_module."
_MODEL_STATES = "mp_rank_00_model_states.pt"
# Keys DeepSpeed's engine writes into the model-state file (DeepSpeedEngine._common_checkpoint_state
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
# Extensions that select the plain state_dict output when the command line says --to auto.
_PLAIN_SUFFIXES = (".pt", ".pth", ".bin")


def _resolve(checkpoint_dir: _PathLike, tag: str | None) -> tuple[Path, str]:
    """The top-level folder and tag of a checkpoint given as the top folder or the tag folder."""
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


def _has_zero_shards(tag_dir: Path) -> bool:
    return any(tag_dir.glob("*_optim_states.pt"))


def _strip(name: str) -> str:
    return name.removeprefix(_WRAPPER_PREFIX)


def _load_trusted(file: Path) -> dict[str, Any]:
    # DeepSpeed pickles its own classes (ZeroStageEnum, fragment_address, ...) into these
    # files, so weights_only=True cannot read them; see the module docstring.
    return torch.load(file, map_location="cpu", weights_only=False, mmap=True)


def _first_model_states(tag_dir: Path) -> Path:
    """The model-state file Lightning's state is read from (ZeRO-3 writes one per rank, all alike)."""
    files = sorted(tag_dir.glob("*model_states.pt"))
    if not files:
        raise ValueError(f"{str(tag_dir)!r} holds no *model_states.pt file: not a DeepSpeed checkpoint.")
    return (tag_dir / _MODEL_STATES) if (tag_dir / _MODEL_STATES).is_file() else files[0]


def consolidate_state_dict(checkpoint_dir: _PathLike, tag: str | None = None) -> OrderedDict[str, torch.Tensor]:
    """Gather a DeepSpeed checkpoint's weights into one fp32 ``state_dict`` on the CPU.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.

    Returns:
        Parameter (and buffer) names of the LightningModule mapped to full fp32 CPU tensors,
        ready for ``module.load_state_dict``.

    Raises:
        ValueError: the folder is not a DeepSpeed checkpoint.

    Note:
        ZeRO 1-3 keep the fp32 master weights in per-rank optimizer shards, which
        ``deepspeed.utils.zero_to_fp32`` knows how to stitch together (any world size).
        ZeRO stage 0 writes no shards: its full weights are in the model-state file.
    """
    top, tag = _resolve(checkpoint_dir, tag)
    tag_dir = top / tag
    if _has_zero_shards(tag_dir):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line per step
            state = get_fp32_state_dict_from_zero_checkpoint(str(top), tag=tag)
    else:
        model_file = tag_dir / _MODEL_STATES
        if not model_file.is_file():
            raise ValueError(
                f"{str(tag_dir)!r} holds neither ZeRO shards nor {_MODEL_STATES}: not a DeepSpeed checkpoint."
            )
        state = _load_trusted(model_file)["module"]
    consolidated: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        consolidated[_strip(name)] = (tensor.float() if tensor.is_floating_point() else tensor).contiguous()
    return consolidated


def read_lightning_state(checkpoint_dir: _PathLike, tag: str | None = None) -> dict[str, Any]:
    """Lightning's own checkpoint entries (epoch, global step, loops, schedulers, callbacks, hparams).

    Lightning hands them to DeepSpeed as ``client_state``, which stores them beside its own
    keys in the model-state file; this returns them without DeepSpeed's.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.

    Raises:
        ValueError: the folder is not a DeepSpeed checkpoint, or was not written by Lightning.
    """
    top, tag = _resolve(checkpoint_dir, tag)
    return _lightning_entries(_load_trusted(_first_model_states(top / tag)), top / tag)


def _lightning_entries(model_state: dict[str, Any], where: Path) -> dict[str, Any]:
    missing = [key for key in _LIGHTNING_KEYS if key not in model_state]
    if missing:
        raise ValueError(
            f"{str(where)!r} lacks Lightning's {missing}: it was not written by trainer.save_checkpoint, so there "
            "is no training progress to resume. Convert the weights only (OUT.pt / convert_checkpoint)."
        )
    return {key: value for key, value in model_state.items() if key not in _DEEPSPEED_KEYS}


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
        (its merge functions are private; the tests pin them to the live DeepSpeed state).
        ``ds_to_universal`` was the other candidate: it hard-codes Adam's two moments (SGD
        fails with KeyError 'exp_avg'), leaves ZeRO-3 tensors flat without ``step``, needs
        state Lightning does not save, and goes through a temporary file per fragment.
    """
    from deepspeed.utils import zero_to_fp32

    merged: OrderedDict[str, Any] = OrderedDict()
    # Silenced: a summary line per call and a progress bar titled "weights" for every state key.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if stage <= 2:
            zero_to_fp32._zero2_merge_trainable_params(merged, world_size, flat_per_rank, model_states, paddings)
        else:
            zero_to_fp32._zero3_merge_trainable_params(merged, world_size, flat_per_rank, model_states)
    return {_strip(name): tensor.contiguous().clone() for name, tensor in merged.items()}


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


def _read_zero_shards(tag_dir: Path) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    """The ZeRO stage, each rank's ZeRO optimizer state and each rank's wrapped torch optimizer state."""
    from deepspeed.utils import zero_to_fp32

    shards = [_load_trusted(Path(f))["optimizer_state_dict"] for f in zero_to_fp32.get_optim_files(str(tag_dir))]
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


def _zero_optimizer_state(tag_dir: Path) -> dict[str, Any]:
    """The optimizer state of a ZeRO 1-3 checkpoint per parameter (see :func:`consolidate_optimizer_state`)."""
    from deepspeed.utils import zero_to_fp32

    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tag_dir)))
    stage, shards, inner = _read_zero_shards(tag_dir)
    groups = inner[0]["param_groups"]
    order = [index for group in groups for index in group["params"]]  # inner state index of each flat partition
    names = [[_strip(n) for n in shapes] for shapes in model_states[0].param_shapes]  # the parameters in each
    if len(order) != len(names) or not all(index in inner[0]["state"] for index in order):
        raise ValueError(
            f"{str(tag_dir)!r}: {len(order)} optimizer partitions for {len(names)} parameter groups, or a partition "
            "with no state (saved before the first optimizer step?): cannot map the optimizer state to parameters."
        )
    fp32 = [shard["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for shard in shards]
    state: dict[str, dict[str, Any]] = {name: {} for flat in names for name in flat}
    for key in inner[0]["state"][order[0]]:
        values = [[rank["state"][index].get(key) for index in order] for rank in inner]
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


def _stage0_optimizer_state(tag_dir: Path) -> dict[str, Any]:
    """The optimizer state of a ZeRO stage 0 checkpoint: a plain torch optimizer state_dict, indexed by position.

    Note:
        Stage 0 saves the optimizer unsharded but with parameter *indices*, not names. They
        are the module's parameters in order only if one group holds all of them, as
        ``torch.optim.X(self.parameters())`` does; anything else is refused rather than guessed.
    """
    model_state = _load_trusted(tag_dir / _MODEL_STATES)
    saved = model_state.get("optimizer")
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        raise ValueError(
            f"{str(tag_dir)!r} holds no torch optimizer state (ZeRO stage 0 with fp16/bf16?): convert the weights only."
        )
    buffers = set(model_state.get("buffer_names") or ())
    module = {_strip(n): t for n, t in model_state["module"].items() if n not in buffers}
    groups = saved["param_groups"]
    order = [index for group in groups for index in group["params"]]
    if len(groups) != 1 or len(order) != len(module):
        raise ValueError(
            f"ZeRO stage 0 saved {len(order)} optimizer parameters in {len(groups)} groups for a module with "
            f"{len(module)}: only one group over all parameters can be mapped to names. Train with ZeRO stage 1-3 "
            "(which records names) or convert the weights only."
        )
    state = {}
    for index, (name, weight) in zip(order, module.items()):
        entry = saved["state"].get(index, {})
        if any(torch.is_tensor(v) and v.dim() > 0 and v.shape != weight.shape for v in entry.values()):
            raise ValueError(
                f"ZeRO stage 0 optimizer entry {index} does not match parameter {name!r}: the optimizer's parameter "
                "order is not the module's. Convert the weights only."
            )
        state[name] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in entry.items()}
    group = {k: v for k, v in groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(module)}]}


def consolidate_optimizer_state(checkpoint_dir: _PathLike, tag: str | None = None) -> dict[str, Any]:
    """Gather a DeepSpeed checkpoint's optimizer state into one dict keyed by parameter name.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        tag: the tag to read; default: the one named in ``latest``.

    Returns:
        ``{"state": {name: {"exp_avg": full tensor, "step": tensor, ...}}, "param_groups":
        [{"lr": ..., ..., "params": [names]}]}`` -- torch's optimizer ``state_dict`` with names
        in place of indices (the form ``get_optimizer_state_dict`` returns), on the CPU.

    Raises:
        ValueError: not a DeepSpeed checkpoint, or optimizer state that is not element-wise
            or scalar per parameter (say, factored second moments), which cannot be re-split.
    """
    top, tag = _resolve(checkpoint_dir, tag)
    tag_dir = top / tag
    return _zero_optimizer_state(tag_dir) if _has_zero_shards(tag_dir) else _stage0_optimizer_state(tag_dir)


def _stand_in_module(weights: dict[str, torch.Tensor], parameters: set[str]) -> nn.Module:
    """An empty module tree holding ``weights`` under their names (parameters as ``nn.Parameter``)."""
    root = nn.Module()
    for name, tensor in weights.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
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


def convert_to_dcp(
    checkpoint_dir: _PathLike, output_dir: _PathLike, tag: str | None = None, optimizer_state: bool = True
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
            keys zeroed (step 0), so the resumed run restarts the optimizer as a new one would.

    Returns:
        The folder written.

    Raises:
        ValueError: not a DeepSpeed checkpoint written by Lightning, or an optimizer state
            that cannot be re-split per parameter (see :func:`consolidate_optimizer_state`).

    Note:
        Runs on one process: DCP saves with ``no_dist=True``, so it also works from a single
        rank of a running job without turning into a collective.
    """
    top, tag = _resolve(checkpoint_dir, tag)
    model_state = _load_trusted(_first_model_states(top / tag))
    metadata = _lightning_entries(model_state, top / tag)
    metadata["lightning_parallel"] = _source_entry(model_state, optimizer_state)
    weights = consolidate_state_dict(top, tag)
    gathered = consolidate_optimizer_state(top, tag)
    optimizer = _flattened_optimizer_state(weights, gathered if optimizer_state else _fresh(gathered))
    return _write_dcp(Path(output_dir), {"state_dict": weights, "optimizer_0": optimizer}, metadata)


def _source_entry(model_state: dict[str, Any], optimizer_state: bool) -> dict[str, Any]:
    """The ``lightning_parallel`` entry of ``meta.pt``: the fields the suite's strategies write, plus the source."""
    stage = int((model_state.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))
    source = f"deepspeed {model_state.get('ds_version', '?')} ZeRO-{stage}"
    return {
        "layout": (int(model_state.get("dp_world_size", 1)), 1, 1),  # (data, pipeline, tensor) of the DeepSpeed run
        "zero_stage": stage,
        "schedule": None,
        "source": source if optimizer_state else f"{source}, optimizer reset",
    }


def _write_dcp(out: Path, state: dict[str, Any], metadata: dict[str, Any]) -> Path:
    """DCP shards into ``.<name>.partial``, then the suite's own commit (``meta.pt``, rename into place)."""
    from torch.distributed.checkpoint import save as dcp_save

    from lightning_parallel.parallel.checkpoint import _partial_path, commit

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_path(out)  # the hidden name commit() renames from
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted conversion
    with warnings.catch_warnings():  # DCP warns that it saves "in a single process": that is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp_save(state, checkpoint_id=partial, no_dist=True)
    commit(out, metadata)
    return out


def convert_checkpoint(checkpoint_dir: _PathLike, output_file: _PathLike, tag: str | None = None) -> Path:
    """Write a DeepSpeed checkpoint's weights as one ``torch.save`` file of a plain ``state_dict``.

    Args:
        checkpoint_dir: the folder written by ``trainer.save_checkpoint`` (or its tag folder).
        output_file: the file to write (its folder is created); written to a temporary
            name first and renamed, so a failed run never leaves a half-written file.
        tag: the tag to read; default: the one named in ``latest``.

    Returns:
        The path written.
    """
    state = consolidate_state_dict(checkpoint_dir, tag)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    torch.save(state, partial)
    partial.replace(out)
    return out


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m lightning_parallel.parallel.deepspeed_checkpoint CKPT_DIR OUT [--to pt|dcp]``.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_parallel.parallel.deepspeed_checkpoint",
        description="Convert a DeepSpeed (ZeRO 0-3) checkpoint folder into a plain PyTorch state_dict file (weights) "
        "or into the suite's DCP checkpoint folder (weights, optimizer state, Lightning state: resumable).",
    )
    parser.add_argument("checkpoint_dir", help="folder written by trainer.save_checkpoint under DeepSpeed")
    parser.add_argument("output", help="OUT.pt: plain state_dict file; any other name (e.g. OUT.ckpt): DCP folder")
    parser.add_argument(
        "--to", choices=("auto", "pt", "dcp"), default="auto",
        help="output format; auto (default): pt when OUT ends in .pt/.pth/.bin, dcp otherwise",
    )
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: read from CKPT_DIR/latest)")
    parser.add_argument(
        "--no-optimizer", action="store_true", help="dcp only: write the optimizer state zeroed (it restarts)"
    )
    args = parser.parse_args(argv)
    to = args.to if args.to != "auto" else ("pt" if Path(args.output).suffix in _PLAIN_SUFFIXES else "dcp")
    if args.no_optimizer and to != "dcp":
        parser.error("--no-optimizer applies to the DCP output only (a .pt file holds weights only anyway)")
    start = time.perf_counter()
    try:
        if to == "pt":
            out = convert_checkpoint(args.checkpoint_dir, args.output, args.tag)
        else:
            out = convert_to_dcp(args.checkpoint_dir, args.output, args.tag, optimizer_state=not args.no_optimizer)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if to == "pt":
        state = torch.load(out, map_location="cpu", weights_only=True)
        numel = sum(t.numel() for t in state.values())
        print(f"wrote {out}: {len(state)} tensors, {numel:,} values ({seconds:.1f}s)")
    else:
        optimizer = "reset to zero" if args.no_optimizer else "carried over"
        print(
            f"wrote DCP checkpoint {out} ({_folder_bytes(out) / 2**20:.1f} MiB, {seconds:.1f}s): weights, optimizer "
            f"state {optimizer}, Lightning state. Resume with Trainer(strategy=...).fit(model, ckpt_path={str(out)!r})."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
