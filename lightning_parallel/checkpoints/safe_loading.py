"""Reading checkpoints without unpickling arbitrary objects: DCP folders, single files, DeepSpeed folders.

torch 2.13's DCP unpickles ``.metadata`` and every non-tensor entry (learning rates, flags of
optimizer param groups) with plain ``pickle``/``torch.load(weights_only=False)``, which would
run any code planted in them. The reader and planner here replace exactly those two reads:
``.metadata`` goes through an allow-list of DCP's own classes, torch sizes/dtypes and plain
containers, and byte entries through ``torch.load(weights_only=True)``. Anything else is
refused with :class:`CheckpointRefused`.

Lightning stores a module's hyper-parameters as ``save_hyperparameters`` kept them: under Hydra
(``lp-train``) nested arguments arrive as OmegaConf ``DictConfig``/``ListConfig``, so every
``torch.load(weights_only=True)`` here runs inside :func:`safe_globals`, which admits exactly
OmegaConf's container, node and metadata classes (and the types they record) -- never a class of the
user's own (a structured config's dataclass, an enum value) nor anything with a ``__reduce__`` payload.

DeepSpeed folders are read the same way (:func:`load_deepspeed_file`), with exactly the DeepSpeed classes
its files hold admitted too; DeepSpeed's own readers (``zero_to_fp32``, ``engine.load_checkpoint``) unpickle
with ``weights_only=False``, so a folder is checked file by file (:func:`check_deepspeed_folder`) before they
see it. A file the user trusts is read without the allow-list only when asked: :data:`TRUST_OPT_IN`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pathlib
import pickle
import typing
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from lightning_parallel._compat import dcp_metadata_path, dcp_set_element, load_planner_target

# How a user says "I trust this file, unpickle whatever it holds" -- one spelling per door.
TRUST_OPT_IN = ("Trainer.fit(..., weights_only=False) or the reader's weights_only=False, lp-train trust_source=true, "
                "or lp-convert --trust-source")
# What DeepSpeed 0.19.8 pickles into a checkpoint beyond tensors and plain values: the ZeRO optimizer shards'
# stage, loss scaler and fragment addresses (seen in the folders Lightning's DeepSpeed strategy writes at ZeRO 0-3,
# fp32, bf16-mixed and bf16-true, AdamW and SGD; the model-state files hold none). fp16 saves a DynamicLossScaler.
DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


class CheckpointRefused(ValueError):
    """The checkpoint holds something other than tensors and plain values (tampered or foreign)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` but only its own classes, torch sizes/dtypes and plain containers."""

    _TORCH_NAMES = {"Size", "device", "dtype", "layout", "memory_format", "strided", "sparse_coo", "contiguous_format",
                    "preserve_format", "channels_last", "channels_last_3d"}

    # The classes torch 2.13's DCP pickles into .metadata (seen in every folder the suite's tests write: suite,
    # Lightning and TorchRec folders, DTensor/FSDP2/pipeline layouts). Named one by one: the rest of
    # torch.distributed.checkpoint holds functions a pickle could call with arguments of its choosing
    # (format_utils.torch_save_to_dcp unpickles any file with weights_only=False).
    _DCP_NAMES = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
            "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            name in self._DCP_NAMES.get(module, ())
            or (
                module == "torch"
                and (name in self._TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.serialization" and name == "_get_layout")
            or (
                module == "pathlib"
                and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
            )
            or (module == "collections" and name == "OrderedDict")
            or (module == "builtins" and name in {"set", "frozenset", "slice", "tuple", "list", "dict"})
        )
        if not allowed:
            raise CheckpointRefused(
                f"Refusing to load a checkpoint whose metadata references {module}.{name}: a checkpoint holds only "
                "tensors and plain values. The file was tampered with or written by something else (DCP writes only "
                "its own classes into .metadata, so no opt-in reads it: save the checkpoint again from its source)."
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with the metadata unpickled through an allow-list.

    Note:
        torch 2.13's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``,
        which would run any code planted in it; tensors themselves are read with
        ``weights_only=True``.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        with self.fs.create_stream(dcp_metadata_path(self, rank), "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``weights_only=True`` (OmegaConf containers admitted).

    Args:
        trusted: read them with ``weights_only=False``: only for entries served from memory out of a file the
            user trusts (a Lightning single file read with ``weights_only=False``), never a folder's.
        **kwargs: ``DefaultLoadPlanner``'s.

    Note:
        The default planner loads byte entries (learning rates, flags of optimizer param
        groups) with ``torch.load(weights_only=False)``.
    """

    def __init__(self, trusted: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trusted = trusted

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            with safe_globals():  # a param group's setting as Hydra gave it (betas as a ListConfig)
                loaded = torch.load(value, weights_only=not self.trusted)
        except pickle.UnpicklingError as error:
            raise CheckpointRefused(
                f"Refusing checkpoint entry {read_item.dest_index.fqn!r}: it holds more than tensors and plain values "
                f"({_first_line(error)}); the folder was tampered with or written by something else."
            ) from None
        flatten, original_state_dict, state_dict, mappings = load_planner_target(self)
        if flatten:  # stored where DefaultLoadPlanner itself would store it
            dcp_set_element(original_state_dict, mappings[read_item.dest_index.fqn], loaded)
        else:
            state_dict[read_item.dest_index.fqn] = loaded


@contextlib.contextmanager
def refusals_unwrapped() -> Iterator[None]:
    """A DCP load inside it raises the :class:`CheckpointRefused` of a refused entry itself.

    Note:
        DCP wraps every exception of a load, :class:`SafeLoadPlanner`'s refusals included, in its
        ``CheckpointException`` (not a ``ValueError``, its message a traceback per rank).
    """
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as error:
        refused = next((cause for cause, _ in error.failures.values() if isinstance(cause, CheckpointRefused)), None)
        if refused is None:
            raise
        raise CheckpointRefused(str(refused)) from None


def _omegaconf_globals() -> list[Any]:
    """The classes a pickled OmegaConf container refers to (found by loading Hydra-written checkpoints).

    Note:
        Containers and nodes are rebuilt by ``__setstate__``, which only stores the given state; the
        types (``int``, ``dict``, ``typing.Any``, ...) appear as the ``ref_type``/``object_type``/
        ``key_type``/``element_type`` of their metadata; ``defaultdict(dict)`` is the resolver cache;
        paths are ``PathNode`` values. Each is harmless to construct, whatever its arguments.
    """
    from omegaconf import DictConfig, ListConfig
    from omegaconf.base import ContainerMetadata, Metadata
    from omegaconf.nodes import AnyNode, BooleanNode, BytesNode, EnumNode, FloatNode, IntegerNode, PathNode, StringNode

    omegaconf = [DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode, BooleanNode, BytesNode, EnumNode,
                 FloatNode, IntegerNode, PathNode, StringNode]
    types = [dict, list, tuple, int, float, bool, str, bytes, typing.Any, defaultdict]
    paths = [pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    return omegaconf + types + paths


@contextlib.contextmanager
def safe_globals() -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside it also accepts OmegaConf containers (Hydra hyper-parameters)."""
    with torch.serialization.safe_globals(_omegaconf_globals()):
        yield


def plain_containers(value: Any) -> Any:
    """``value`` with every OmegaConf container inside turned into dicts and lists, interpolations unresolved.

    A file written from it loads with a plain ``torch.load(weights_only=True)`` (Lightning's own
    ``fit(ckpt_path=...)`` on torch >= 2.6) without :func:`safe_globals`, unless a value is a path.

    Note:
        Not resolved: a checkpoint is data, and resolving would run resolvers (``oc.env`` reads the
        environment) on what the file says. Hydra resolves the values it hands a module's ``__init__``,
        so hyper-parameters hold no interpolations in practice. The container classes themselves
        (Lightning's ``hparams_type`` when ``save_hyperparameters(cfg)`` kept a ``DictConfig``) become
        their names, which ``load_from_checkpoint`` reads as its ``AttributeDict``.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if value is DictConfig or value is ListConfig:
        return value.__name__
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=False)
    if isinstance(value, dict):
        plain = copy.copy(value)  # an OrderedDict or Lightning's AttributeDict stays what it was
        plain.update((key, plain_containers(item)) for key, item in value.items())
        return plain
    if type(value) in (list, tuple):
        return type(value)(plain_containers(item) for item in value)
    return value


def _first_line(error: BaseException) -> str:
    """The line of an unpickling error that names what was refused (torch's opens with generic advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed") and len(lines) > 1:
        return lines[1]
    return lines[0] if lines else type(error).__name__


def refusal(file: Any, error: BaseException) -> CheckpointRefused:
    """The error for a file whose pickle holds objects beyond the allow-list, naming the opt-in."""
    return CheckpointRefused(
        f"Refusing {str(file)!r}: it holds objects other than tensors and plain values ({_first_line(error)}). It was "
        f"tampered with, or saved extra objects; unpickling them runs whatever they hold. If you trust its origin, "
        f"pass {TRUST_OPT_IN}."
    )


def load_plain(file: Any, weights_only: bool = True) -> Any:
    """``torch.load`` of a file that must hold only tensors and plain values (``meta.pt``).

    Args:
        file: the file to read.
        weights_only: passed to ``torch.load``; ``False`` only for files the caller trusts.

    Raises:
        CheckpointRefused: the file holds other objects (tampered or foreign).
    """
    try:
        with safe_globals():
            return torch.load(file, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        raise refusal(file, error) from None


def _deepspeed_globals() -> list[Any]:
    """The classes of :data:`DEEPSPEED_GLOBALS` (none without DeepSpeed: its ZeRO shards then stay refused)."""
    import importlib

    try:
        return [getattr(importlib.import_module(module), name) for module, name in DEEPSPEED_GLOBALS]
    except ImportError:
        return []


def load_deepspeed_file(file: Any, weights_only: Optional[bool] = None) -> Any:
    """``torch.load`` of a DeepSpeed model- or optimizer-state file, memory-mapped on the CPU.

    Args:
        file: a ``*_model_states.pt`` or ``*_optim_states.pt`` file.
        weights_only: ``None``/``True``: tensors, plain values, OmegaConf containers (Hydra's
            hyper-parameters in Lightning's entries) and :data:`DEEPSPEED_GLOBALS` only; ``False``:
            anything (a file the user trusts).

    Raises:
        CheckpointRefused: the file holds other objects (tampered or foreign).

    Note:
        ``DynamicLossScaler``, ``LossScaler`` and ``fragment_address`` are rebuilt by setting their
        ``__dict__`` and ``ZeroStageEnum`` by its value: none runs code of the file's choosing.
    """
    try:
        with torch.serialization.safe_globals(_omegaconf_globals() + _deepspeed_globals()):
            return torch.load(file, map_location="cpu", mmap=True, weights_only=weights_only is not False)
    except pickle.UnpicklingError as error:
        raise refusal(file, error) from None


def check_deepspeed_folder(tag_dir: Any, weights_only: Optional[bool] = None) -> None:
    """Refuse a DeepSpeed tag folder any of whose ``.pt`` files holds more than :func:`load_deepspeed_file` admits.

    Call it before DeepSpeed's own readers see the folder (``zero_to_fp32``, ``engine.load_checkpoint``): they
    unpickle every file with ``weights_only=False``, which runs whatever a tampered file holds.

    Args:
        tag_dir: the tag folder (``checkpoint/`` of what ``trainer.save_checkpoint`` wrote).
        weights_only: ``False``: the user trusts the folder, nothing is checked.

    Raises:
        CheckpointRefused: a file holds other objects (tampered or foreign).

    Note:
        Each file's pickle is read once more; its tensors are memory-mapped, not read.
    """
    if weights_only is False:
        return
    for file in sorted(pathlib.Path(tag_dir).rglob("*.pt")):
        load_deepspeed_file(file)
