"""The model adapter a strategy asks, adapted once per module and kept on the strategy (never on the module)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.adapters import ModelAdapter, adapt


def strategy_adapter(strategy: Any, refresh: bool = False) -> ModelAdapter:
    """``adapt(strategy.lightning_module)``, cached on the strategy until the module changes.

    Args:
        strategy: a suite strategy (its ``lightning_module`` is the module being trained).
        refresh: resolve again even for the same module -- in ``setup``, after ``configure_model``
            may have built the model inside it (the one meaning of "resolve" in strategies/ is a layout: resolve.py).
    """
    cached: Optional[ModelAdapter] = getattr(strategy, "resolved_model_adapter", None)
    if refresh or cached is None or cached.module is not strategy.lightning_module:
        cached = adapt(strategy.lightning_module)
        strategy.resolved_model_adapter = cached
    return cached
