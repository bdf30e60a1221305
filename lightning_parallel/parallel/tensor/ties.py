"""Tied parameters (one tensor under several names) stay one tensor under tensor parallelism.

``parallelize_module`` replaces each planned submodule's parameters with new DTensor
parameters, one submodule at a time, so a weight shared by two submodules -- a token
embedding tied to the LM head (``tie_word_embeddings=True``) -- silently becomes two
parameters that train apart (measured: 0.41 loss drift in 7 steps). Here a tie is checked
before any process group (:func:`check_ties`: both owners must shard the weight the same
way) and restored after sharding (:func:`restore_ties`: every name points at one DTensor
parameter again), and a tie that cannot be restored is an error, never a silent untie.

Note:
    Re-tying is exact when both owners place the weight alike: a vocabulary-sharded
    embedding (``RowwiseParallel`` on ``nn.Embedding``: ``Shard(0)`` of the ``(V, H)``
    weight) and a column-sharded head (``ColwiseParallel`` on ``nn.Linear``: ``Shard(0)`` of
    the same ``(V, H)`` weight) hold the same rows on every rank; both were distributed from
    the same tensor, so their shards are equal, and keeping one of them gives the single
    parameter whose gradient is the sum of both uses, as in one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

TieGroups = list[list[str]]


def tie_groups(module: nn.Module) -> TieGroups:
    """Qualified names of every parameter held under more than one name, grouped by tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def weight_placement(style: Optional[ParallelStyle], submodule: nn.Module) -> str:
    """How ``style`` places ``submodule``'s weight: ``"Shard(dim=0)"``, ``"Replicate()"``, ``"unsharded"`` ...

    ``"unknown"`` for a custom style whose effect cannot be told before it runs (the tie is
    then checked after sharding by :func:`restore_ties`).
    """
    if style is None:
        return "unsharded"
    embedding = isinstance(submodule, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return repr(Shard(1 if embedding else 0))
    if isinstance(style, RowwiseParallel):
        return repr(Shard(0 if embedding else 1))
    if isinstance(style, SequenceParallel):
        return repr(Replicate())
    return "unsharded" if type(style).__module__.startswith("lightning_parallel") else "unknown"


def check_ties(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Refuse a plan that would shard a tied weight differently under its names.

    Args:
        module: the model (or a pipeline stage of it), before sharding.
        plan: ``{submodule name: style}`` from ``concrete_plan``.

    Raises:
        ValueError: naming the tied names, each owner's style and the fix.
    """
    for names in tie_groups(module):
        placements = {}
        for name in names:
            owner = _owner(name)
            placements[name] = weight_placement(plan.get(owner), module.get_submodule(owner))
        known = {p for p in placements.values() if p != "unknown"}
        if len(known) > 1:
            shown = "; ".join(
                f"{name}: {placements[name]} (plan {_owner(name)!r}: {_style_name(plan.get(_owner(name)))})"
                for name in names
            )
            raise ValueError(
                f"{' and '.join(names)} are one tied parameter, but the tensor-parallel plan places it differently "
                f"under its names ({shown}); sharding would untie them and they would train apart. Fix: give both "
                "owners styles that shard the same dimension (a vocabulary-sharded embedding 'embedding_rowwise' "
                "with a column-sharded head 'colwise_gather'), or leave both out of the plan."
            )


def _style_name(style: Optional[ParallelStyle]) -> str:
    return "not in the plan" if style is None else type(style).__name__


def restore_ties(module: nn.Module, groups: TieGroups) -> None:
    """Point every name of each tied group at one parameter again after ``parallelize_module``.

    Args:
        module: the sharded module.
        groups: :func:`tie_groups` of ``module`` taken before sharding.

    Raises:
        ValueError: the names now hold parameters of different placements or shapes, which
            cannot be one tensor (a plan :func:`check_ties` could not judge).
    """
    from torch.distributed.tensor import DTensor

    for names in groups:
        params = [module.get_parameter(name) for name in names]
        keep = params[0]
        if all(p is keep for p in params):
            continue

        def layout(p: nn.Parameter) -> tuple:
            return (tuple(p.shape), p.placements if isinstance(p, DTensor) else "plain")

        if any(layout(p) != layout(keep) for p in params):
            described = "; ".join(f"{n}: {layout(p)}" for n, p in zip(names, params))
            raise ValueError(
                f"Tensor parallelism untied {' and '.join(names)} ({described}) and they cannot be tied again. "
                "Fix: give their owners styles that shard the weight the same way, or leave both out of the plan."
            )
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_parameter(leaf, keep)
