"""Check a resolved tensor-parallel plan before any process group exists: it shards something, the tensor size
divides every dimension it splits (layers and the adapter's head counts), and tied weights stay tied.

:func:`validate_tensor_parallel` is the entry; :mod:`.plan` resolves the plan it checks and calls it again on the
submodules a rank holds when it applies the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_parallel.parallel.tensor.gradients import holds
from lightning_parallel.parallel.tensor.styles import STYLE_NAMES, PrepareFirstInput, SumGradients
from lightning_parallel.parallel.tensor.ties import check_ties

if TYPE_CHECKING:
    from lightning_parallel.parallel.adapter import ModelAdapter

__all__ = ["validate_tensor_parallel"]


def _sharded_dimensions(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, int]]:
    """``(description, size)`` of every model dimension the plan splits across tensor ranks."""
    dims: list[tuple[str, int]] = []
    for name, style in plan.items():
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            continue  # lives on another pipeline stage
        if isinstance(style, ColwiseParallel):
            if isinstance(sub, nn.Linear):
                dims.append((f"{name} has out_features={sub.out_features}", sub.out_features))
            elif isinstance(sub, nn.Embedding):
                dims.append((f"{name} has embedding_dim={sub.embedding_dim}", sub.embedding_dim))
        elif isinstance(style, RowwiseParallel):
            if isinstance(sub, nn.Linear):
                dims.append((f"{name} has in_features={sub.in_features}", sub.in_features))
            elif isinstance(sub, nn.Embedding):
                dims.append((f"{name} has num_embeddings={sub.num_embeddings} (vocabulary rows)", sub.num_embeddings))
    # Attention heads: a column-sharded projection below a module with a head count
    # splits the heads, and a rank must hold whole heads.
    for owner, sub in module.named_modules():
        heads = next(
            (getattr(sub, a) for a in ("n_head", "n_heads", "num_heads") if isinstance(getattr(sub, a, None), int)),
            None,
        )
        if heads is None:
            continue
        prefix = f"{owner}." if owner else ""
        if any(name.startswith(prefix) and isinstance(style, ColwiseParallel) for name, style in plan.items()):
            dims.append((f"{owner or type(module).__name__} has {heads} heads", heads))
    return dims


def validate_tensor_parallel(
    module: nn.Module,
    plan: Mapping[str, ParallelStyle],
    tensor_parallel_size: int,
    *,
    require_sharding: bool = True,
    adapter: ModelAdapter,
) -> None:
    """Check that ``plan`` shards something, divides by ``tensor_parallel_size`` and keeps ties.

    Runs before any process group exists (a ``meta``-device model is fine). The dimensions
    checked are those of the sharded layers and, for a Hugging Face model, the attention
    and key/value head counts of its config.

    Args:
        module: the model (or a pipeline stage of it) the plan applies to.
        plan: the output of :func:`concrete_plan`.
        tensor_parallel_size: ranks per tensor-parallel group.
        require_sharding: refuse a plan that shards no parameter when the size is above 1
            (off for a pipeline stage, which may hold none of the planned layers).
        adapter: the model's adapter, resolved once by the caller: adds dimensions the layers do not show (a
            config's head counts) and the hint for a model that brought no plan.

    Raises:
        ValueError: a plan that shards nothing (every rank would train the whole model),
            each dimension that does not divide (``"blocks.0.attn has 4 heads"``) with the
            sizes that divide all of them, or a tied weight the plan would untie.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer.")
    if require_sharding and tensor_parallel_size > 1 and not any(_shards_parameters(s) for s in plan.values()):
        raise _nothing_to_shard(module, tensor_parallel_size, bool(plan), adapter.missing_plan_hint())
    dims = _sharded_dimensions(module, plan) + adapter.head_dimensions(plan)
    bad = [(desc, size) for desc, size in dims if size % tensor_parallel_size]
    if bad:
        raise _indivisible(dims, bad, tensor_parallel_size)
    check_ties(module, {name: style for name, style in plan.items() if holds(module, name)})


def _shards_parameters(style: ParallelStyle) -> bool:
    """Whether ``style`` splits parameters (the suite's input/output and norm styles only move activations)."""
    moves_activations = (PrepareModuleInput, PrepareModuleOutput, SequenceParallel, PrepareFirstInput, SumGradients)
    return not isinstance(style, moves_activations)


def _nothing_to_shard(module: nn.Module, tensor_parallel_size: int, has_entries: bool, held: str) -> ValueError:
    what = "only moves activations" if has_entries else "is empty"
    return ValueError(
        f"tensor_parallel_size={tensor_parallel_size}, but the tensor-parallel plan of {type(module).__name__} {what}: "
        f"nothing would be sharded and every rank would hold and train the whole model{held}. Fix: define "
        "tensor_parallel_plan() on the module returning {submodule name or glob: style} (styles: "
        f"{', '.join(STYLE_NAMES)}), pass the strategy plan={{...}}, or set tensor_parallel_size=1."
    )


def _indivisible(dims: list[tuple[str, int]], bad: list[tuple[str, int]], tensor_parallel_size: int) -> ValueError:
    common = {d for d in range(1, dims[0][1] + 1) if dims[0][1] % d == 0}
    for _, size in dims[1:]:
        common &= {d for d in range(1, size + 1) if size % d == 0}
    # Heads first (the usual culprit), then one example per distinct kind and size:
    # every layer of a stack repeats the same dimension.
    bad.sort(key=lambda item: " heads" not in item[0])
    seen, shown = set(), []
    for desc, size in bad:
        kind = (desc.split(" has ")[-1].split("=")[0].split()[-1], size)
        if kind not in seen:
            seen.add(kind)
            shown.append(desc)
    more = len(bad) - len(shown)
    listed = "; ".join(shown) + (f" (and {more} more layers of these sizes)" if more else "")
    return ValueError(
        f"tensor_parallel_size={tensor_parallel_size} does not divide what the plan shards: {listed}. "
        f"Sizes that divide every sharded dimension: {', '.join(map(str, sorted(common)))}."
    )
