"""Model adapters: ``adapt(module) -> ModelAdapter``, resolved once per run, answer everything the engine asks.

A LightningModule's own protocol methods (:mod:`lightning_parallel.protocol`) always win; an
adapter answers only what the module leaves open. The interface and the protocol's answers are
:class:`~lightning_parallel.parallel.adapter.ModelAdapter`; :class:`.HuggingFaceAdapter` understands
a Hugging Face ``transformers`` model held as a submodule (its ``tp_plan``, ``pp_plan``, config head
counts, tied weights, causal-LM loss, checkpoint entry). New model families are new adapters here,
not branches in the engine.
"""

from __future__ import annotations

from torch import nn

from lightning_parallel.adapters.hf.adapter import HuggingFaceAdapter
from lightning_parallel.parallel.adapter import ModelAdapter

__all__ = ["AdapterCache", "HuggingFaceAdapter", "ModelAdapter", "adapt"]


ModelAdapter.register(HuggingFaceAdapter)


def adapt(module: nn.Module) -> ModelAdapter:
    """The adapter that answers for ``module``: the first registered family that understands it (a Hugging Face
    model held inside it), else the protocol's (:class:`ModelAdapter`). Strategies call it once per run.

    Args:
        module: the LightningModule (or any module) to be parallelised.

    Raises:
        ValueError: ``module`` holds two unrelated Hugging Face models and defines neither
            ``pipeline_layers()`` nor ``tensor_parallel_plan()`` (the suite splits one model; the message
            says to define the protocol methods).
    """
    return ModelAdapter.resolve(module)


class AdapterCache:
    """``adapt(module)`` once per module, for callers that see the module at every batch (callbacks).

    Calling it returns the strategy's own adapter when the strategy keeps one (the suite's do:
    ``strategy.adapter``), else one resolved here and kept until the module changes.
    """

    def __init__(self) -> None:
        self._adapter: ModelAdapter | None = None

    def __call__(self, module: nn.Module, strategy: object = None) -> ModelAdapter:
        """The adapter of ``module`` (``strategy``: the Trainer's strategy, asked first)."""
        own = getattr(strategy, "adapter", None)
        if isinstance(own, ModelAdapter) and own.module is module:
            return own
        if self._adapter is None or self._adapter.module is not module:
            self._adapter = adapt(module)
        return self._adapter
