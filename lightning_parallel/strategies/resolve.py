"""The layout a strategy will run, however it is given: the suite's one resolution of it.

A strategy reaches the suite as an object, a class, a zero-argument factory (``functools.partial``),
or a name in Lightning's ``StrategyRegistry`` (``"pipeline_parallel"``, ``"deepspeed_zero2"``,
Lightning's ``"ddp"``). :func:`resolve_layout` turns each into the
:class:`~lightning_parallel.layout.ParallelLayout` the Trainer will run: the suite's strategies
answer with their own ``resolve_layout``, everything else is data parallel (``"auto"``).
``lp-train``'s preflight, ``strategy=planned``, ``lp-compare``, ``compare_layouts`` and the test fits
all ask here, so the data a layout is fed always matches the layout that trains.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Optional

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_parallel.layout import ParallelLayout

__all__ = ["resolve_layout", "strategy_object"]

def _has_layout(cls: Any) -> bool:
    """Whether instances of ``cls`` resolve their own layout (the suite's data x pipeline x tensor strategies)."""
    return isinstance(cls, type) and callable(getattr(cls, "resolve_layout", None))


def strategy_object(strategy: Any, registry: Optional[Mapping[str, Any]] = None) -> Any:
    """The strategy object that decides its own layout, or None for a data-parallel strategy.

    Only what can decide a layout is built: a class or registered name of the suite's strategies is
    instantiated (cheap: no process group), Lightning's own (``"ddp"``, ``"auto"``, DeepSpeed) are not.

    Args:
        strategy: an object, a class, a zero-argument factory (``functools.partial`` or function) or a
            registered name.
        registry: where names are looked up (default: Lightning's ``StrategyRegistry``).

    Raises:
        ValueError: the strategy's own arguments are invalid (its constructor's message).
    """
    if isinstance(strategy, str):
        names = StrategyRegistry if registry is None else registry
        entry = names[strategy] if strategy in names else None  # not .get(): Lightning's builds the strategy
        if not isinstance(entry, Mapping) or not _has_layout(entry.get("strategy")):
            return None  # "auto", Lightning's names, or a name Lightning itself will refuse
        return entry["strategy"](**entry.get("init_params", {}))
    if isinstance(strategy, Strategy):
        return strategy if callable(getattr(strategy, "resolve_layout", None)) else None
    if isinstance(strategy, type):
        return strategy() if _has_layout(strategy) else None
    if isinstance(strategy, functools.partial) and isinstance(strategy.func, type):
        return strategy() if _has_layout(strategy.func) else None
    if callable(strategy):  # any other zero-argument factory: what it builds decides
        return strategy_object(strategy(), registry)
    return strategy if callable(getattr(strategy, "resolve_layout", None)) else None


def resolve_layout(
    strategy: Any,
    world_size: int,
    *,
    names: Optional[Mapping[str, str]] = None,
    num_nodes: Optional[int] = None,
    registry: Optional[Mapping[str, Any]] = None,
) -> ParallelLayout:
    """The data x pipeline x tensor layout ``strategy`` runs on ``world_size`` processes (no processes needed).

    Args:
        strategy: an object, a class, a zero-argument factory or a registered name (see :func:`strategy_object`).
        world_size: processes in the run (devices x nodes).
        names: how layout errors spell each setting (e.g. ``lp-train``'s ``strategy.pipeline_parallel_size``);
            default: the strategy's own argument names.
        num_nodes: nodes in the run, for the messages (default: the strategy's, else 1).
        registry: where names are looked up (default: Lightning's ``StrategyRegistry``).

    Raises:
        ValueError: sizes that do not fit ``world_size`` (or invalid strategy arguments), naming the fix.
    """
    built = strategy_object(strategy, registry)
    if built is not None:
        return built.resolve_layout(world_size, names=names, num_nodes=num_nodes)
    return ParallelLayout.resolve(world_size, data_parallel="auto", names=names, num_nodes=num_nodes or 1)
