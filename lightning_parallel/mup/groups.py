"""μP's optimizer: the hidden weights in groups of their own at lr x ``base_width / width``, the rest at the base lr.

Note:
    Groups are made from the parameters the module holds *now* and their names, which every layout keeps (FSDP2,
    tensor parallelism and DeepSpeed ZeRO-3 shard a parameter without renaming it; a pipeline rank holds its stages'
    parameters under their unsplit names), so the same names land in the same groups on every rank and layout. A
    parameter's dimensions are its full ones (``ds_shape`` under ZeRO-3), not its local slice's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.mup.width import ROLES, MupWidth

#: Optimizers whose μP is the one :mod:`.width` prescribes: the update of each entry is normalised entry-wise.
ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)

Role = Callable[[str, Tensor], str]  # (parameter name, parameter) -> one of ROLES


def full_ndim(param: Tensor) -> int:
    """The parameter's dimensions as created (``ds_shape`` under DeepSpeed ZeRO-3, which leaves a flat slice)."""
    return len(getattr(param, "ds_shape", param.shape))


def check_mup_optimizer(factory: Any) -> None:
    """Refuse an optimizer μP's rules here do not cover.

    Args:
        factory: the optimizer class or a ``functools.partial`` of it (Hydra's ``_partial_: true``).

    Raises:
        ValueError: not ``torch.optim.Adam``/``AdamW``; the message names the settings that fix it.
    """
    func = getattr(factory, "func", factory)
    if func in ADAM_FAMILY:
        return
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', func)}"
    raise ValueError(
        f"scaling=mup prescribes the learning rates of Adam-family optimizers (torch.optim.Adam, torch.optim.AdamW), "
        f"not {name} (SGD's and Muon's hidden weights scale otherwise; Muon's own adjust_lr_fn=match_rms_adamw is "
        "its width rule): set model.optimizer._target_=torch.optim.AdamW, or leave μP out (drop scaling=mup and "
        "model.base_width).")


def mup_roles(module: nn.Module, role: Role) -> dict[str, str]:
    """Every trainable parameter's μP role (:data:`~.width.ROLES`), by name.

    Args:
        module: the model (its parameters as held now).
        role: ``role(name, parameter)``: the recipe's or the adapter's classification.

    Raises:
        ValueError: ``role`` answers something that is not a role.
    """
    roles = {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            roles[name] = role(name, param)
            if roles[name] not in ROLES:
                raise ValueError(f"{name}: role {roles[name]!r} is not one of {ROLES}.")
    return roles


def _split(groups: Sequence[dict[str, Any]], hidden: set[int]) -> list[dict[str, Any]]:
    """Each group twice: its hidden parameters (``"mup": "hidden"``) and the others (``"mup": "base"``); no empties."""
    split = []
    for group in groups:
        params = list(group["params"])
        for kind, chosen in (("hidden", [p for p in params if id(p) in hidden]),
                             ("base", [p for p in params if id(p) not in hidden])):
            if chosen:
                split.append({**group, "params": chosen, "mup": kind})
    return split


def mup_optimizer(factory: Callable[..., torch.optim.Optimizer], groups: Sequence[dict[str, Any]],
                  module: nn.Module, role: Role, width: MupWidth) -> torch.optim.Optimizer:
    """``factory(groups)`` with the hidden parameters in groups of their own at μP's lr and weight decay.

    The groups a recipe builds (weight decay or not) are kept and split in two; each hidden group's ``lr`` is the base
    lr x ``base_width / width`` and its ``weight_decay`` x ``width / base_width`` (AdamW's decay per step,
    ``lr x weight_decay``, as at the base width). Build the learning-rate scheduler after this call: it takes each
    group's lr as it finds it.

    Args:
        factory: the optimizer factory (``torch.optim.AdamW`` or a partial of it).
        groups: the recipe's parameter groups.
        module: the model, for the parameters' names.
        role: ``role(name, parameter)`` -> one of :data:`~.width.ROLES`.
        width: the model's width against its base width.

    Raises:
        ValueError: an optimizer outside :data:`ADAM_FAMILY`, or a role that is not one of :data:`~.width.ROLES`.
    """
    check_mup_optimizer(factory)
    roles = mup_roles(module, role)
    hidden = {id(p) for name, p in module.named_parameters() if roles.get(name) == "hidden"}
    optimizer = factory(_split(groups, hidden))
    for group in optimizer.param_groups:
        if group.get("mup") == "hidden":
            group["lr"] = group["lr"] * width.hidden_lr_factor
            group["weight_decay"] = group.get("weight_decay", 0.0) * width.multiplier
    return optimizer
