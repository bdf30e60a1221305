"""Tensor parallelism on DTensor: resolve a module's plan, validate it, apply it.

A plan maps submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``) to a style
name of :data:`STYLE_NAMES` or a torch ``ParallelStyle``. :func:`resolve_plan` turns it
into ``{concrete name: ParallelStyle}`` for one model and one choice of sequence /
loss parallelism, :func:`validate_tensor_parallel` checks the sizes before any process
group exists, and :func:`apply_tensor_parallel` calls ``parallelize_module`` on the
submodules a (pipeline-stage) module actually holds.

Style names (what each becomes without / with ``sequence_parallel``):

* ``colwise`` -- ``ColwiseParallel()`` in both cases. Its input must be replicated: under
  sequence parallelism put ``gather_input`` on the parent that receives the stream.
* ``rowwise`` -- ``RowwiseParallel()`` (all-reduce) / output ``Shard(1)`` (reduce-scatter).
* ``embedding_rowwise`` -- ``RowwiseParallel(input_layouts=Replicate())``, vocabulary rows
  sharded / output ``Shard(1)``: the embedding output *is* the residual stream.
* ``embedding_rowwise_replicated`` -- the same, but the output stays replicated under
  sequence parallelism too (something is added to it before the stream starts).
* ``colwise_gather`` -- ``ColwiseParallel(output_layouts=Replicate())`` for an LM head /
  input ``Shard(1)``; with ``loss_parallel`` the output stays a ``Shard(-1)`` DTensor.
* ``sequence`` -- dropped / ``SequenceParallel()`` (norms).
* ``gather_input`` -- ``PrepareModuleInput(Replicate -> Replicate)`` as a DTensor, so the
  projections inside share one input and its gradient is all-reduced once, not once per
  projection / ``PrepareModuleInput(Shard(1) -> Replicate)`` (all-gather on entry).
* ``scatter_output`` -- dropped / ``PrepareModuleOutput(Replicate -> Shard(1))``, a local
  slice with no communication.

Note:
    Under sequence parallelism the residual stream between blocks is a *local* tensor
    holding this rank's slice of the sequence (dim 1), as in torchtitan's
    ``parallelize_llama``: norms run on the slice (``sequence``), a block's attention or
    MLP gathers the full sequence on entry (``gather_input``) and its last row-parallel
    layer reduce-scatters back to the slice (``rowwise``). An embedding whose output is
    combined with something replicated before it joins the stream (a learned position
    table) keeps a replicated output (``embedding_rowwise_replicated``) and its parent
    slices the sum (``scatter_output``, a local slice with no communication).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Union

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PlanValue = Union[str, ParallelStyle, None]

_NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.Dropout)
# The sequence dimension of activations shaped (batch, sequence, features).
_SEQ = 1


def _colwise(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    # Also under sequence parallelism the input is expected replicated (a parent's
    # ``gather_input`` made it so). Declaring Shard(1) here would make torch insert a
    # Replicate->Replicate redistribute whose backward all-reduces the input gradient once
    # per projection instead of once per block (measured: +4 all-reduces per block).
    return ColwiseParallel()


def _rowwise(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    return RowwiseParallel(output_layouts=Shard(_SEQ)) if sp else RowwiseParallel()


def _embedding_rowwise(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    # Token ids are replicated; each rank looks up its vocabulary rows and the partial
    # sums are reduced (all-reduce, or reduce-scatter straight into the sequence slice).
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(_SEQ) if sp else Replicate())


def _embedding_rowwise_replicated(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _colwise_gather(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    # Under loss parallelism the logits stay vocabulary-sharded DTensors, which
    # loss_parallel()'s cross-entropy consumes without ever gathering the vocabulary.
    return ColwiseParallel(
        input_layouts=Shard(_SEQ) if sp else Replicate(),
        output_layouts=Shard(-1) if lp else Replicate(),
        use_local_output=not lp,
    )


def _sequence(module: nn.Module, sp: bool, lp: bool) -> Optional[ParallelStyle]:
    return SequenceParallel(sequence_dim=_SEQ) if sp else None


def _gather_input(module: nn.Module, sp: bool, lp: bool) -> ParallelStyle:
    return PrepareModuleInput(
        input_layouts=(Shard(_SEQ) if sp else Replicate(),),
        desired_input_layouts=(Replicate(),),
        use_local_output=False,
    )


def _scatter_output(module: nn.Module, sp: bool, lp: bool) -> Optional[ParallelStyle]:
    if not sp:
        return None
    return PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(_SEQ),), use_local_output=True)


# name -> (module types it fits, factory). ``nn.Module`` means any module.
_STYLES: dict[str, tuple[tuple[type[nn.Module], ...], Callable[[nn.Module, bool, bool], Optional[ParallelStyle]]]] = {
    "colwise": ((nn.Linear, nn.Embedding), _colwise),
    "rowwise": ((nn.Linear,), _rowwise),
    "embedding_rowwise": ((nn.Embedding,), _embedding_rowwise),
    "embedding_rowwise_replicated": ((nn.Embedding,), _embedding_rowwise_replicated),
    "colwise_gather": ((nn.Linear,), _colwise_gather),
    "sequence": (_NORMS, _sequence),
    "gather_input": ((nn.Module,), _gather_input),
    "scatter_output": ((nn.Module,), _scatter_output),
}

STYLE_NAMES: tuple[str, ...] = tuple(_STYLES)


def _excerpt(names: list[str], pattern: str, limit: int = 12) -> str:
    """A short list of existing module names: the children of the longest prefix of ``pattern`` that matches."""
    parts = pattern.split(".")
    chosen: list[str] = []
    for k in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:k])
        chosen = [n for n in names if fnmatch.fnmatchcase(n, f"{parent}.*") and "." not in n[len(parent) + 1 :]]
        if not chosen:
            # A glob parent ("blocks.*") matches across depths; keep direct children only.
            chosen = [n for n in names if n.count(".") == k and fnmatch.fnmatchcase(n, f"{parent}.*")]
        if chosen:
            break
    if not chosen:
        chosen = [n for n in names if "." not in n]  # the top-level submodules
    more = len(chosen) - limit
    return ", ".join(chosen[:limit]) + (f", ... ({more} more)" if more > 0 else "")


def _expand(module: nn.Module, plan: Mapping[str, PlanValue], source: str) -> dict[str, tuple[str, PlanValue]]:
    """Expand each pattern of ``plan`` to concrete names: ``{name: (pattern, value)}``."""
    names = [name for name, _ in module.named_modules() if name]
    out: dict[str, tuple[str, PlanValue]] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{source} key {pattern!r} is not a submodule name or glob pattern.")
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"{source} pattern {pattern!r} matches no submodule of {type(module).__name__}. "
                f"Existing names include: {_excerpt(names, pattern)}."
            )
        for name in matched:
            if name in out and out[name][1] is not value and out[name][1] != value:
                raise ValueError(
                    f"{source} patterns {out[name][0]!r} and {pattern!r} both match {name!r} with different styles "
                    f"({out[name][1]!r} vs {value!r}): make the patterns disjoint."
                )
            out[name] = (pattern, value)
    return out


def _to_style(name: str, submodule: nn.Module, value: PlanValue, sp: bool, lp: bool) -> Optional[ParallelStyle]:
    if isinstance(value, ParallelStyle):
        return value
    if not isinstance(value, str) or value not in _STYLES:
        raise ValueError(
            f"Plan entry {name!r} has style {value!r}: use one of {', '.join(STYLE_NAMES)} or a torch ParallelStyle."
        )
    types, factory = _STYLES[value]
    if not isinstance(submodule, types):
        fits = [style for style, (style_types, _) in _STYLES.items() if isinstance(submodule, style_types)]
        raise ValueError(
            f"Style {value!r} does not fit {name!r}, a {type(submodule).__name__}: it applies to "
            f"{' / '.join(t.__name__ for t in types)}. Styles that fit a {type(submodule).__name__}: {', '.join(fits)}."
        )
    return factory(submodule, sp, lp)


def resolve_plan(
    module: nn.Module,
    overrides: Optional[Mapping[str, PlanValue]] = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """Resolve ``module``'s tensor-parallel plan to concrete submodule names and styles.

    The module's own ``tensor_parallel_plan()`` (if it has one) is expanded first, then
    ``overrides``: an override wins for every concrete name its pattern matches, and an
    override value ``None`` removes the names it matches. Styles that only act under
    sequence parallelism (``sequence``, ``scatter_output``) are dropped without it.

    Args:
        module: the full model (every layer present, on any device including ``meta``).
        overrides: extra or replacing entries, pattern -> style name, ``ParallelStyle``
            or ``None`` (remove); for example the strategy's ``plan`` from Hydra.
        sequence_parallel: shard norms and the residual stream along the sequence (dim 1).
        loss_parallel: keep the LM head's logits vocabulary-sharded for
            :func:`loss_parallel_context`'s cross-entropy.

    Returns:
        ``{concrete name: ParallelStyle}`` in the order of ``module.named_modules()``.

    Raises:
        ValueError: a pattern matches no submodule (the message lists names that
            exist), a style name is unknown or does not fit the submodule's type, or two
            patterns of one source give one submodule different styles.
    """
    own = getattr(module, "tensor_parallel_plan", None)
    base = dict(own()) if callable(own) else {}
    merged = _expand(module, base, "tensor_parallel_plan()")
    if overrides:
        for name, (pattern, value) in _expand(module, overrides, "Plan override").items():
            if value is None:
                merged.pop(name, None)
            else:
                merged[name] = (pattern, value)
    plan: dict[str, ParallelStyle] = {}
    for name, submodule in module.named_modules():
        if name in merged:
            style = _to_style(name, submodule, merged[name][1], sequence_parallel, loss_parallel)
            if style is not None:
                plan[name] = style
    _check_gathered_inputs(merged, plan)
    return plan


def _check_gathered_inputs(merged: Mapping[str, tuple[str, PlanValue]], plan: Mapping[str, ParallelStyle]) -> None:
    """A gathered input is a DTensor: a plain layer reading it fails deep in the forward
    ("mixed torch.Tensor and DTensor"), so say here what is wrong."""
    for name, (_, value) in merged.items():
        if value == "gather_input" and not any(
            inner.startswith(f"{name}.") and isinstance(style, ColwiseParallel) for inner, style in plan.items()
        ):
            raise ValueError(
                f"{name!r} has 'gather_input' but no column-sharded submodule to read its input: remove the "
                f"'gather_input' entry along with the sharding inside {name!r}, or shard its input projections colwise."
            )


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
        heads = next((getattr(sub, a) for a in ("n_head", "n_heads", "num_heads") if isinstance(getattr(sub, a, None), int)), None)
        if heads is None:
            continue
        prefix = f"{owner}." if owner else ""
        if any(name.startswith(prefix) and isinstance(style, ColwiseParallel) for name, style in plan.items()):
            dims.append((f"{owner or type(module).__name__} has {heads} heads", heads))
    return dims


def validate_tensor_parallel(module: nn.Module, plan: Mapping[str, ParallelStyle], tensor_parallel_size: int) -> None:
    """Check that ``tensor_parallel_size`` divides every dimension ``plan`` shards.

    Runs before any process group exists (a ``meta``-device model is fine).

    Args:
        module: the model (or a pipeline stage of it) the plan applies to.
        plan: the output of :func:`resolve_plan`.
        tensor_parallel_size: ranks per tensor-parallel group.

    Raises:
        ValueError: naming each dimension that does not divide (``"blocks.0.attn has 4
            heads"``) and the sizes that divide all of them.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer.")
    dims = _sharded_dimensions(module, plan)
    bad = [(desc, size) for desc, size in dims if size % tensor_parallel_size]
    if bad:
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
        shown = "; ".join(shown) + (f" (and {more} more layers of these sizes)" if more else "")
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} does not divide what the plan shards: {shown}. "
            f"Sizes that divide every sharded dimension: {', '.join(map(str, sorted(common)))}."
        )


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Shard ``module`` in place over ``tp_mesh`` with ``parallelize_module``.

    Args:
        module: the model or a pipeline stage holding some of its layers under their
            original qualified names; plan names it does not hold are skipped (they live
            on another stage).
        tp_mesh: the one-dimensional tensor-parallel mesh (``mesh["tensor_parallel"]``).
        plan: the output of :func:`resolve_plan` for the full model.

    Returns:
        ``module`` (planned submodules hold DTensor parameters); unchanged on a mesh of one rank.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D, or its size does not divide a sharded dimension.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names}: pass mesh['tensor_parallel']."
        )
    if tp_mesh.size() == 1:
        return module
    present = {}
    for name, style in plan.items():
        try:
            module.get_submodule(name)
        except AttributeError:
            continue
        present[name] = style
    validate_tensor_parallel(module, present, tp_mesh.size())
    from torch.distributed.tensor.parallel import parallelize_module

    # One call per name: concrete names need no glob matching, and a name containing
    # fnmatch metacharacters cannot be misread as a pattern.
    for name, style in present.items():
        submodule = module.get_submodule(name)
        parallelize_module(submodule, tp_mesh, style)
        _settle_gradients(submodule)
    return module


def _settle_gradients(module: nn.Module) -> None:
    """Give each DTensor parameter's gradient the parameter's placement, once, in backward.

    Note:
        torch leaves some gradients in another placement than their parameter: a
        ``SequenceParallel`` norm's replicated weight gets a ``Partial`` (unreduced)
        gradient, a vocabulary-sharded embedding a replicated one. Every later use (each
        optimizer op, the clipping norm) would then redistribute it again -- 30
        all-reduces in one AdamW step of a 2-block GPT -- and a ``Partial`` gradient read
        through ``to_local()`` is wrong. One redistribution in the gradient hook fixes both.
    """
    from torch.distributed.tensor import DTensor

    for param in module.parameters(recurse=False):
        if isinstance(param, DTensor) and param.requires_grad:
            placements = param.placements
            param.register_hook(
                lambda grad, placements=placements: grad.redistribute(placements=placements)
                if isinstance(grad, DTensor) and grad.placements != placements
                else grad
            )


def loss_parallel_context(enabled: bool) -> ContextManager[None]:
    """torch's ``loss_parallel()`` when ``enabled``, else a no-op context.

    Wrap both the cross-entropy and its ``backward()`` in it: the logits are then the
    vocabulary-sharded DTensor that ``colwise_gather`` gives under ``loss_parallel``.

    Args:
        enabled: whether the plan was resolved with ``loss_parallel=True``.
    """
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
