"""Initialising one module of a Hugging Face model as ``from_config`` would, also where ``_init_weights`` does not.

The suite initialises a model built on ``meta`` module by module with the model's own ``_init_weights``
(:func:`lightning_parallel._compat.hf_init_weights`). A few modules set their tensors in their constructor and
``_init_weights`` leaves them alone -- Apertus's xIELU activation (``alpha_p``, ``alpha_n`` and its ``beta``
and ``eps`` buffers) -- so after ``to_empty`` they would hold whatever the memory held (measured: 7.6e31 in
``alpha_n`` under tensor 2), and some are set by their parent's branch (Qwen3-Next's sparse MoE block draws
its router's weight), which a module initialised on its own never meets. :func:`init_hf_module` finds them
(floating tensors still NaN after the initialiser ran on NaN-filled ones), runs the ancestors' branches on
stand-ins for them holding the module alone, and for what is still unset takes the values of a fresh instance
of the module's class built as the model's constructor built it (its defaults, the config, the layer index).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.adapters.hf.model import is_hf_model
from lightning_parallel.adapters.hf.mup import scale_hidden_init
from lightning_parallel.parallel.data import own_class


def _own(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def _owner(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """The Hugging Face model whose ``_init_weights`` transformers applies to ``module``: the module itself when it is
    one (Gemma 3n's base model reads its own ``hidden_size``), else the innermost one holding it."""
    if is_hf_model(module):
        return module
    parts = name.split(".") if name else []
    for depth in range(len(parts) - 1, 0, -1):
        try:
            holder = model.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            break
        if is_hf_model(holder):
            return holder
    return model


def _stand_in(ancestor: nn.Module, attr: str, child: nn.Module) -> Optional[nn.Module]:
    """An instance of ``ancestor``'s class with its plain attributes (config, sizes) and ``child`` as its only child;
    no tensor is copied (the ancestor may be sharded by FSDP2, or not materialised). None if it cannot be made."""
    cls = own_class(ancestor)  # not FSDP2's FSDP<Name>: the stand-in is of the model's class
    try:
        holder = cls.__new__(cls)
        nn.Module.__init__(holder)
        for key, value in vars(ancestor).items():
            if not key.startswith("_") and not isinstance(value, (nn.Module, Tensor)) and key != "training":
                setattr(holder, key, value)
        setattr(holder, attr, child)
    except (AttributeError, TypeError):
        return None
    return holder


def _from_ancestors(model: nn.Module, name: str, module: nn.Module, floating: list[tuple[str, Tensor]]) -> None:
    """Run the enclosing modules' ``_init_weights`` branches, innermost first, on stand-ins holding ``module`` alone.

    transformers initialises some tensors from an ancestor's branch: Qwen3-Next's sparse MoE block draws its
    router's weight, Falcon-H1's base model writes each mixer's ``mup_vector``. Each stand-in
    (:func:`_stand_in`) holds only the path down to ``module``, so a branch writes into ``module`` and nothing
    else; a branch that needs a sibling the stand-in lacks is skipped.
    """
    parts, child = name.split("."), module
    for depth in range(len(parts) - 1, -1, -1):
        where = ".".join(parts[:depth])
        try:
            holder = _stand_in(model.get_submodule(where), parts[depth], child)
        except AttributeError:
            return
        if holder is None:
            return
        try:
            _compat.hf_init_weights(_owner(model, where, holder), holder)
        except (AttributeError, TypeError, IndexError, KeyError):
            pass
        if not _unset(floating):
            return
        child = holder


def _fresh(model: nn.Module, name: str, module: nn.Module, dtype: torch.dtype) -> Optional[dict[str, Tensor]]:
    """A new instance's own tensors, built with its defaults plus the model's ``config``, the layer index (from the
    module's name) and ``dtype`` where its constructor asks for them; None when it asks for anything else."""
    cls = type(module)
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer = next((int(part) for part in reversed(name.split(".")) if part.isdigit()), None)
    known = {"config": config, "layer_idx": layer, "layer_index": layer, "dtype": dtype}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    wanted = {key: known[key] for key in parameters if known.get(key) is not None}
    if any(p.default is p.empty and p.kind in kinds and key not in wanted for key, p in parameters.items()):
        return None
    try:
        with torch.device("cpu"):
            return dict(_own(cls(**wanted)))
    except Exception:  # noqa: BLE001 -- a constructor that needs more than that: the caller says so
        return None


def _unset(floating: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    return [(attr, t) for attr, t in floating if bool(torch.isnan(t).any())]


def init_hf_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """``_init_weights(module)`` of the model owning it, then its parents' branches and constructor values for the
    tensors it left unset; under μP a hidden weight's std is then scaled (:func:`~.mup.scale_hidden_init`).

    Args:
        model: the Hugging Face model.
        name: the module's name inside ``model`` (``""``: the model itself).
        module: the module to initialise (it, or a copy of it on another device).

    Raises:
        ValueError: a tensor neither ``_init_weights`` nor a freshly built instance of its class sets.
    """
    _init_own(model, name, module)
    scale_hidden_init(model, name, module)


def _init_own(model: nn.Module, name: str, module: nn.Module) -> None:
    """:func:`init_hf_module` without μP's scaling."""
    floating = [(attr, t) for attr, t in _own(module) if t.is_floating_point() and not t.is_meta]
    with torch.no_grad():
        for _, tensor in floating:
            tensor.fill_(float("nan"))
        _compat.hf_init_weights(_owner(model, name, module), module)
        if name and _unset(floating):
            _from_ancestors(model, name, module, floating)
    unset = _unset(floating)
    if not unset:
        return
    values = _fresh(model, name, module, unset[0][1].dtype) or {}
    missing = [attr for attr, t in unset if attr not in values or values[attr].shape != t.shape]
    if missing:
        raise ValueError(
            f"{type(model).__name__}'s _init_weights leaves {type(module).__name__}.{missing} unset and the class "
            "cannot be built alone to take them from: a model built on the meta device would start from "
            "uninitialised memory. Build it with storage (Lightning's own strategies), or load its weights."
        )
    with torch.no_grad():
        for attr, tensor in unset:
            tensor.copy_(values[attr].to(tensor.dtype))
