"""A :class:`~lightning_parallel.planner.shapes.ModelShape` from an instantiated module and one sample batch.

Parameters come from the module itself (exact); which of them tensor parallelism shards, from
its ``tensor_parallel_plan()`` (the same glob -> style plan the strategies apply); forward FLOPs
from ``torch.utils.flop_counter``; the bytes autograd saves for backward from one micro-batch
through ``saved_tensors_hooks``; forward+backward seconds per layer from
:func:`lightning_parallel.parallel.pipeline.partition.measure_layer_times`, the function the ``time``
partition uses; the attention context parallelism would split (sequence, heads, head size) from the
``q, k`` that the modules its ``context_parallel_plan()`` calls ``"attention"`` receive; the experts expert
parallelism would split (count, top-k, widths, tokens) from the modules its ``expert_parallel_plan()`` calls
``"experts"`` (their parameters flagged as experts) and the MoE block holding each; the splits of the batch the
model refuses from its adapter's ``check_batch_split``.
"""

from __future__ import annotations

import fnmatch
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.planner.shapes import AttentionShape, ExpertShape, LayerShape, ModelShape, Param

# Which dimension of a weight each plan style shards, and whether the bias is sharded with it.
_WEIGHT_DIM = {"colwise": 0, "colwise_gather": 0, "embedding_rowwise": 0, "embedding_rowwise_replicated": 0,
               "rowwise": 1, "rowwise_replicated_input": 1, "embedding_colwise": 1}
_BIAS_SHARDED = {"colwise", "colwise_gather"}
# Styles whose forward all-reduces (row-parallel: partial outputs), and whose backward does (column-parallel:
# partial input gradients, one all-reduce per module as DTensor runs them).
_ALL_REDUCE_STYLES = {"rowwise", "rowwise_replicated_input", "embedding_rowwise", "embedding_rowwise_replicated"}
_BACKWARD_REDUCE_STYLES = {"colwise", "colwise_gather", "embedding_colwise"}
# Share of a transformer block's saved activations that tensor parallelism divides (Korthikanti et al. 2022,
# 24 of 34 s*b*h terms without sequence parallelism); a layer without sharded parameters keeps all of them.
_TP_SHARDED_SHARE = 24 / 34


def _style_of(name: str, plan: Mapping[str, Any], prefix: str) -> Optional[str]:
    """The plan style whose glob matches module ``prefix + name`` (the last match wins, as a dict update would)."""
    found = None
    for pattern, style in plan.items():
        if isinstance(style, str) and fnmatch.fnmatchcase(prefix + name, pattern):
            found = style
    return found


def _layer_params(layer: nn.Module, plan: Mapping[str, Any], prefix: str,
                  experts: frozenset[int] = frozenset()) -> tuple[tuple[Param, ...], int, int]:
    """Parameters of ``layer`` with their tensor-parallel dims (and whether they are experts: modules whose ids are
    in ``experts``); forward and backward all-reducing modules."""
    params, reducing, backward = [], 0, 0
    for module_name, module in layer.named_modules():
        style = _style_of(module_name, plan, prefix) if module_name else _style_of("", plan, prefix.rstrip("."))
        reducing += style in _ALL_REDUCE_STYLES
        backward += style in _BACKWARD_REDUCE_STYLES
        for pname, p in module.named_parameters(recurse=False):
            dim = _WEIGHT_DIM.get(style) if pname == "weight" else (0 if style in _BIAS_SHARDED else None)
            params.append(Param(tuple(p.shape), dim, id(module) in experts))
    return tuple(params), reducing, backward


def _experts_modules(module: nn.Module) -> dict[str, nn.Module]:
    """The submodules ``module.expert_parallel_plan()`` maps to ``"experts"``, by name (none without a plan)."""
    plan = getattr(module, "expert_parallel_plan", None)
    globs = [pattern for pattern, style in dict(plan()).items() if style == "experts"] if callable(plan) else []
    return {name: m for name, m in module.named_modules() if name and any(fnmatch.fnmatchcase(name, g) for g in globs)}


def _expert_shape(module: nn.Module, name: str, layer: nn.Module, inp: Tensor) -> ExpertShape:
    """The experts module ``name`` of ``module`` as an :class:`ExpertShape`: its count and widths, the top-k of the
    block holding it, and the tokens that block receives when ``layer`` runs on ``inp`` (one sample)."""
    experts = module.get_submodule(name)
    block = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
    count = int(experts.num_experts)
    seen: list[Tensor] = []
    handle = block.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            layer(inp)
    finally:
        handle.remove()
    x = seen[0]
    width = x.shape[-1]
    per_expert = sum(p.numel() for p in experts.parameters()) // count
    up = getattr(experts, "w_up", None)
    hidden = int(up.shape[-1]) if up is not None else per_expert // (2 * width)
    top_k = int(getattr(block, "top_k", getattr(experts, "top_k", 1)))
    return ExpertShape(count, top_k, width, hidden, x.numel() // (width * inp.shape[0]), per_expert, x.element_size())


def _split_refusals(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """``(axis, reason)`` for each split of the batch (data, pipeline, context) the model refuses at start-up."""
    from lightning_parallel.parallel.adapter import ModelAdapter

    try:
        check = ModelAdapter.resolve(module).check_batch_split
    except (TypeError, ValueError):  # not a model the suite adapts: nothing to ask
        return ()
    refusals = []
    for axis in ("data", "pipeline", "context"):
        try:
            check([f"{axis}_parallel_size=2"])
        except ValueError as error:
            refusals.append((axis, str(error)))
    return tuple(refusals)


def _layer_prefixes(module: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    names = {id(m): n for n, m in module.named_modules()}
    return [names.get(id(layer), "") + "." for layer in layers]


def _saved_bytes(layer: nn.Module, inp: Tensor) -> tuple[int, Tensor]:
    """Bytes autograd saves in ``layer``'s forward (parameters excluded), and the output."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = inp.detach().requires_grad_(inp.is_floating_point())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return sum(seen.values()), out.detach()


def _attention_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules ``module.context_parallel_plan()`` maps to ``"attention"`` (none without a plan)."""
    plan = getattr(module, "context_parallel_plan", None)
    if plan is None:
        return []
    globs = [pattern for pattern, style in dict(plan()).items() if style == "attention"]
    return [m for name, m in module.named_modules() if name and any(fnmatch.fnmatchcase(name, g) for g in globs)]


def _attention_shape(modules: Sequence[nn.Module], layer: nn.Module, inp: Tensor) -> Optional[AttentionShape]:
    """The ``(q, k)`` the first of ``modules`` that ``layer`` calls on ``inp`` receives, as an AttentionShape."""
    seen: list[AttentionShape] = []

    def record(_: nn.Module, args: tuple) -> None:
        if len(args) >= 2 and all(isinstance(t, Tensor) and t.dim() == 4 for t in args[:2]):
            q, k = args[0], args[1]
            seen.append(AttentionShape(q.shape[2], q.shape[1], k.shape[1], q.shape[3], q.element_size()))

    handles = [m.register_forward_pre_hook(record) for m in modules]
    try:
        with torch.no_grad():
            layer(inp)
    finally:
        for handle in handles:
            handle.remove()
    return seen[0] if seen else None


def _flops(layer: nn.Module, inp: Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        layer(inp)
    return counter.get_total_flops()


def profile_module(module: nn.Module, sample: Tensor, name: str = "model", optimizer_states: int = 2) -> ModelShape:
    """Measure a protocol module's pipeline layers on ``sample`` (the first layer's input, any batch size >= 1).

    Args:
        module: a module offering ``pipeline_layers()`` (and ``tensor_parallel_plan()`` for tensor parallelism).
        sample: one batch of inputs for the first pipeline layer; per-sample figures divide by its size.
        name: the model's name in tables.
        optimizer_states: optimizer state tensors per parameter (2 for Adam/AdamW, 1 for SGD with momentum).
    """
    layers = list(module.pipeline_layers())
    plan = dict(module.tensor_parallel_plan()) if hasattr(module, "tensor_parallel_plan") else {}
    batch = sample.shape[0]
    shapes, x = [], sample[:1]
    attention_modules, attention = _attention_modules(module), None
    experts_modules, experts = _experts_modules(module), None
    expert_ids = frozenset(id(m) for e in experts_modules.values() for m in e.modules())
    for layer, prefix in zip(layers, _layer_prefixes(module, layers)):
        params, reducing, backward = _layer_params(layer, plan, prefix, expert_ids)
        flops = _flops(layer, x)
        saved, out = _saved_bytes(layer, x)
        sharded = _TP_SHARDED_SHARE * saved if any(p.tp_dim is not None for p in params) else 0.0
        held = [m for m in layer.modules() if any(m is a for a in attention_modules)]
        if held and attention is None:
            attention = _attention_shape(held, layer, x)
        moe = [n for n, m in experts_modules.items() if any(m is own for own in layer.modules())]
        if moe and experts is None:
            experts = _expert_shape(module, moe[0], layer, x)
        shapes.append(LayerShape(
            name=prefix.rstrip(".") or f"layer{len(shapes)}", params=params, fwd_flops=float(flops),
            activation_sharded=sharded, activation_replicated=saved - sharded,
            output_bytes=float(out.numel() * out.element_size()),
            tp_all_reduce_bytes=float(reducing * out.numel() * out.element_size()), tp_collectives=reducing + backward,
            attention_modules=len(held), moe_modules=len(moe),
        ))
        x = out
    # The loss after the last layer keeps its log-probabilities (cross-entropy's saved tensor, logits-sized).
    last = shapes[-1]
    shapes[-1] = replace(last, activation_replicated=last.activation_replicated + last.output_bytes)
    divides = _tp_limits(module)
    timer = _layer_timer(layers, sample)
    return ModelShape(name, tuple(shapes), tp_divides=divides, optimizer_states=optimizer_states,
                      measured_seconds=timer, source=f"instantiated, measured on {batch} sample(s)",
                      attention=attention, experts=experts, split_refusals=_split_refusals(module))


def _tp_limits(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """Sizes a tensor-parallel degree must divide: attention heads and every sharded dimension."""
    hp = getattr(module, "hparams", {}) or {}
    limits = [(k, int(hp[k])) for k in ("n_head", "num_heads", "d_model", "vocab_size") if isinstance(hp.get(k), int)]
    return tuple(limits)


def _layer_timer(layers: Sequence[nn.Module], sample: Tensor, rounds: int = 3):
    """``f(micro_batch) -> seconds per layer``, linear in the micro-batch between two measured sizes.

    Each layer is timed at one sample and at the whole sample batch, ``rounds`` times, keeping the fastest
    (the least disturbed by other processes); other sizes are interpolated (extrapolated beyond), so the
    times of different micro-batch counts come from the same two measurements and rank consistently.
    """
    from lightning_parallel.parallel.pipeline.partition import measure_layer_times

    big = sample.shape[0]

    @lru_cache(maxsize=1)
    def ends() -> tuple[list[float], list[float]]:
        small_runs = [measure_layer_times(layers, sample[:1], repeats=3) for _ in range(rounds)]
        big_runs = [measure_layer_times(layers, sample, repeats=3) for _ in range(rounds)]
        return [min(r) for r in zip(*small_runs)], [min(r) for r in zip(*big_runs)]

    # Structurally identical layers (the blocks) take one time: the median over them, which a burst of
    # load on a shared machine moves less than any single layer's.
    signature = [tuple((type(m).__name__, tuple(p.shape)) for m in layer.modules() for p in m.parameters(recurse=False))
                 for layer in layers]

    def same_layers(times: list[float]) -> list[float]:
        groups: dict[tuple, list[float]] = {}
        for key, t in zip(signature, times):
            groups.setdefault(key, []).append(t)
        return [statistics.median(groups[key]) for key in signature]

    def seconds(micro_batch: int) -> tuple[float, ...]:
        small, large = (same_layers(t) for t in ends())
        if big == 1:
            return tuple(s * micro_batch for s in small)
        return tuple(max(0.0, s + (micro_batch - 1) * (b - s) / (big - 1)) for s, b in zip(small, large))

    return seconds
