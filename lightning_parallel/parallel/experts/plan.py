"""Expert parallelism applied to a module that follows the protocol: its experts modules sharded over the expert axis.

A module offers ``expert_parallel_plan()``: submodule globs mapped to ``"experts"`` -- a module holding an MoE
layer's grouped expert weights (``num_experts``, ``w_up``/``w_down`` with experts along dimension 0,
``expert_mlp``, ``keep``; :class:`examples.nlp.moe.GroupedExperts` is one). Each is replaced by
:class:`~lightning_parallel.parallel.experts.sharded.ExpertParallel`: this rank keeps ``E / ep`` consecutive
experts (``Shard(0)`` DTensors on the expert mesh, so names, checkpoints and initial values are those of the
unsplit model) and tokens travel to the rank holding their expert by all-to-all. The router and everything
else stay as the other axes treat them; the experts' gradients are reduced over the expert-data group
(:func:`~lightning_parallel.parallel.experts.sharded.reduce_expert_gradients`), not by the data axis.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

EXPERT_STYLES = ("experts",)


def matching_experts(module: nn.Module, plan: Mapping[str, str], owner: str, size: int,
                     whole: bool = True) -> list[str]:
    """Names of the experts modules ``plan`` names, checked for ``size`` expert ranks.

    Args:
        module: the model (``meta`` or with storage).
        plan: ``{glob: "experts"}``.
        owner: the class named in messages.
        size: the expert-parallel size.
        whole: whether ``module`` is the whole model (every glob must match; a pipeline rank's share may hold none).

    Raises:
        ValueError: an unknown style, a glob naming no module, a module without ``num_experts``, or an expert
            count ``size`` does not divide (with the sizes that do).
    """
    names = [name for name, _ in module.named_modules() if name]
    found: list[str] = []
    for pattern, style in plan.items():
        if style not in EXPERT_STYLES:
            raise ValueError(f"{owner}'s expert_parallel_plan maps {pattern!r} to {style!r}: use 'experts'.")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and whole:
            raise ValueError(f"{owner}'s expert_parallel_plan pattern {pattern!r} matches no submodule: fix the glob.")
        found += hits
    if whole and not found:
        raise ValueError(f"expert_parallel_size={size}, but {owner}'s expert_parallel_plan names no experts module: "
                         "name the MoE layers' experts, or set expert_parallel_size=1.")
    for name in found:
        experts = int(getattr(module.get_submodule(name), "num_experts", 0))
        if not experts or experts % size:
            divisors = [d for d in range(1, experts + 1) if experts and experts % d == 0]
            raise ValueError(f"{owner}.{name} holds {experts or 'no num_experts'} experts, which "
                             f"expert_parallel_size={size} does not divide: use a size among {divisors}.")
    return found


def apply_expert_plan(model: nn.Module, names: list[str], mesh: Any, capacity_group: Optional[Any],
                      kernel: Optional[Any] = None) -> list[str]:
    """Replace each experts module of ``names`` that this rank holds by its expert-parallel share.

    Args:
        model: the model after its pipeline split.
        names: the experts modules' names (:func:`matching_experts`).
        mesh: the 1-D expert mesh (``expert_parallel`` ranks).
        capacity_group: the data x context group, over which capacity is decided as one process would.
        kernel: torch's grouped GEMM (``lightning_parallel._compat.grouped_mm``), or None for the loop.
    """
    from lightning_parallel.parallel.experts.sharded import ExpertParallel

    present = dict(model.named_modules())
    replaced = []
    for name in names:
        if name not in present or not hasattr(present[name], "num_experts"):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallel(present[name], mesh.get_group(), capacity_group, kernel, mesh=mesh))
        replaced.append(name)
    return replaced
