"""Tensor parallelism on DTensor: a module's plan made concrete and applied (validation: :mod:`.validation`).

A plan maps submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``) to a style
name of :data:`STYLE_NAMES` (see :mod:`.styles` for what each becomes) or a torch
``ParallelStyle``. :func:`concrete_plan` turns it into ``{concrete name: ParallelStyle}``
for one model and one choice of sequence / loss parallelism, :func:`validate_tensor_parallel`
checks the sizes (and tied weights) before any process group exists, and
:func:`apply_tensor_parallel` calls ``parallelize_module`` on the submodules a
(pipeline-stage) module actually holds and keeps tied weights one parameter.

Where the plan comes from is the model adapter's answer
(:meth:`~lightning_parallel.parallel.adapter.ModelAdapter.tensor_plan`: the module's own
``tensor_parallel_plan()``, or the plan of a Hugging Face model it holds, re-rooted under the
model's attribute path); the strategy's ``plan=`` overrides it. Every function here takes that
adapter, resolved once by the caller (``lightning_parallel.adapters.adapt(module)``), as ``adapter=``.

Note:
    Under sequence parallelism the residual stream between blocks is a *local* tensor
    holding this rank's slice of the sequence (dim 1), as in torchtitan's
    ``parallelize_llama``: norms run on the slice (``sequence``), a block's attention or
    MLP gathers the full sequence on entry (``gather_input``) and its last row-parallel
    layer reduce-scatters back to the slice (``rowwise``). An embedding whose output is
    combined with something replicated before it joins the stream (a learned position
    table) keeps a replicated output (``embedding_rowwise_replicated``) and its parent
    slices the sum (``scatter_output``, a local slice with no communication); a Hugging
    Face decoder, which builds its mask and rotary positions from the embedding output,
    slices at its first layer's input instead (``scatter_input``).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Mapping
from typing import TYPE_CHECKING, ContextManager, Optional, Union

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_parallel.parallel.tensor.aliases import RefusedStyle, suite_style
from lightning_parallel.parallel.tensor.gradients import holds, settle_gradients
from lightning_parallel.parallel.tensor.styles import STYLE_NAMES, to_style
from lightning_parallel.parallel.tensor.ties import restore_ties, tie_groups
from lightning_parallel.parallel.tensor.validation import validate_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_parallel.parallel.adapter import ModelAdapter

__all__ = [
    "STYLE_NAMES", "apply_tensor_parallel", "loss_parallel_context", "concrete_plan", "validate_tensor_parallel",
]

PlanValue = Union[str, ParallelStyle, RefusedStyle, None]


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


def _merge(
    module: nn.Module, overrides: Optional[Mapping[str, PlanValue]], sequence_parallel: bool, adapter: ModelAdapter
) -> dict[str, tuple[str, PlanValue]]:
    """The adapter's plan expanded, then the overrides' names replacing or removing (``None``) its entries."""
    source, base = adapter.tensor_plan(sequence_parallel)
    merged = _expand(module, base, source)
    if overrides:
        translated = {pattern: suite_style(value) for pattern, value in overrides.items()}
        for name, (pattern, value) in _expand(module, translated, "Plan override").items():
            if value is None:
                merged.pop(name, None)
            else:
                merged[name] = (pattern, value)
    return merged


def concrete_plan(
    module: nn.Module,
    overrides: Optional[Mapping[str, PlanValue]] = None,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    adapter: ModelAdapter,
) -> dict[str, ParallelStyle]:
    """Resolve ``module``'s tensor-parallel plan to concrete submodule names and styles.

    The module's own ``tensor_parallel_plan()`` -- or, without one, the plan of the Hugging
    Face model it holds -- is expanded first, then ``overrides``: an override wins for every
    concrete name its pattern matches, and an override value ``None`` removes the names it
    matches. Styles that only act under sequence parallelism are dropped without it.

    Args:
        module: the full model (every layer present, on any device including ``meta``).
        overrides: extra or replacing entries, pattern -> style name (the suite's, or a
            transformers name such as ``colwise_gather_output``), ``ParallelStyle`` or
            ``None`` (remove); for example the strategy's ``plan`` from Hydra.
        sequence_parallel: shard norms and the residual stream along the sequence (dim 1).
        loss_parallel: keep the LM head's logits vocabulary-sharded for
            :func:`loss_parallel_context`'s cross-entropy (only the head's: see :func:`loss_head`).
        adapter: the model's adapter, resolved once by the caller: answers where the base plan comes from.

    Returns:
        ``{concrete name: ParallelStyle}`` in the order of ``module.named_modules()``.

    Raises:
        ValueError: a pattern matches no submodule (the message lists names that exist),
            a style name is unknown, refused (a transformers style the suite cannot run) or
            does not fit the submodule's type, or two patterns of one source give one
            submodule different styles.
    """
    merged = _merge(module, overrides, sequence_parallel, adapter)
    ordered = {name: merged[name][1] for name, _ in module.named_modules() if name in merged}
    head = loss_head(ordered) if loss_parallel else None
    plan: dict[str, ParallelStyle] = {}
    for name, submodule in module.named_modules():
        if name in merged:
            if isinstance(merged[name][1], RefusedStyle):
                raise merged[name][1].error(name)
            style = to_style(name, submodule, merged[name][1], sequence_parallel, name == head)
            if style is not None:
                plan[name] = style
    _check_gathered_inputs(merged, plan)
    return plan


def loss_head(plan: Mapping[str, PlanValue]) -> Optional[str]:
    """The entry whose logits stay vocabulary-sharded under ``loss_parallel``: the last ``colwise_gather`` entry
    of ``plan`` (concrete names in the module's order) outside the repeated blocks.

    Note:
        ``colwise_gather`` also plans fused projections inside the blocks (Phi-3's ``qkv_proj`` and ``gate_up_proj``
        under transformers' ``colwise_gather_output``): their outputs are split and multiplied with plain tensors,
        so they must be gathered as without loss parallelism. A block is a numbered entry of a module list
        (``layers.3.mlp.gate_up_proj``); the LM head is not inside one.
    """
    candidates = [name for name, value in plan.items()
                  if value == "colwise_gather" and not any(part.isdigit() for part in name.split("."))]
    return candidates[-1] if candidates else None


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


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle], adapter: ModelAdapter
) -> nn.Module:
    """Shard ``module`` in place over ``tp_mesh`` with ``parallelize_module``.

    Args:
        module: the model or a pipeline stage holding some of its layers under their
            original qualified names; plan names it does not hold are skipped (they live
            on another stage).
        tp_mesh: the one-dimensional tensor-parallel mesh (``mesh["tensor_parallel"]``).
        plan: the output of :func:`concrete_plan` for the full model.
        adapter: the model's adapter, resolved once by the caller (head counts, tied-embedding promise).

    Returns:
        ``module`` (planned submodules hold DTensor parameters, a tied weight stays one
        parameter); unchanged on a mesh of one rank.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D, its size does not divide a sharded dimension,
            or sharding broke a tie it cannot restore.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh "
            f"{tp_mesh.mesh_dim_names}: pass mesh['tensor_parallel']."
        )
    if tp_mesh.size() == 1:
        return module
    present = {name: style for name, style in plan.items() if holds(module, name)}
    validate_tensor_parallel(module, present, tp_mesh.size(), require_sharding=False, adapter=adapter)
    ties = tie_groups(module)
    from torch.distributed.tensor.parallel import parallelize_module

    # One call per name: concrete names need no glob matching, and a name containing
    # fnmatch metacharacters cannot be misread as a pattern.
    for name, style in present.items():
        submodule = module.get_submodule(name)
        parallelize_module(submodule, tp_mesh, style)
        settle_gradients(submodule)
    restore_ties(module, ties)
    untied = adapter.untied_embeddings()
    if untied is not None:
        raise ValueError(
            f"{untied} after tensor parallelism: they would train apart. Tie them before parallelising "
            "(model.tie_weights() after materialising a meta-device model), or set tie_word_embeddings=False."
        )
    return module


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
