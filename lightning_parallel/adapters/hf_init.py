"""Initialising one module of a Hugging Face model as ``from_config`` would, also where ``_init_weights`` does not.

The suite initialises a model built on ``meta`` module by module with the model's own ``_init_weights``
(:func:`lightning_parallel._compat.hf_init_weights`). A few modules set their tensors in their constructor and
``_init_weights`` leaves them alone -- Apertus's xIELU activation (``alpha_p``, ``alpha_n`` and its ``beta``
and ``eps`` buffers) -- so after ``to_empty`` they would hold whatever the memory held (measured: 7.6e31 in
``alpha_n`` under tensor 2), and some are set by their parent's branch (Qwen3-Next's sparse MoE block draws
its router's weight), which a module initialised on its own never meets. :func:`init_hf_module` finds them
(floating tensors still NaN after the initialiser ran on NaN-filled ones), runs the parents' branches on a
meta copy of the parent holding the module, and for what is still unset takes the values of a fresh instance
of the module's class built as the model's constructor built it (its defaults, the config, the layer index).
"""

from __future__ import annotations

import copy
import inspect
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.adapters.hf import is_hf_model


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


def _from_parents(model: nn.Module, name: str, module: nn.Module) -> None:
    """Run each enclosing module's ``_init_weights`` branch on a meta copy of it holding ``module``.

    transformers initialises some tensors from their parent's branch (Qwen3-Next's sparse MoE block draws its
    router's weight): a copy of the parent on the meta device, with ``module`` put in its place, lets that branch
    write into ``module`` alone. Hugging Face models themselves are not copied (that would be the whole model).
    """
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        try:
            parent = model.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            return
        if is_hf_model(parent):
            return
        holder = copy.deepcopy(parent).to_empty(device="meta")
        inner = holder.get_submodule(".".join(parts[depth:-1])) if depth < len(parts) - 1 else holder
        setattr(inner, parts[-1], module)
        _compat.hf_init_weights(_owner(model, name, holder), holder)


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
    tensors it left unset.

    Args:
        model: the Hugging Face model.
        name: the module's name inside ``model`` (``""``: the model itself).
        module: the module to initialise (it, or a copy of it on another device).

    Raises:
        ValueError: a tensor neither ``_init_weights`` nor a freshly built instance of its class sets.
    """
    floating = [(attr, t) for attr, t in _own(module) if t.is_floating_point() and not t.is_meta]
    with torch.no_grad():
        for _, tensor in floating:
            tensor.fill_(float("nan"))
        _compat.hf_init_weights(_owner(model, name, module), module)
        if name and _unset(floating):
            _from_parents(model, name, module)
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
