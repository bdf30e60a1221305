"""The Hugging Face adapter's room: a ``transformers`` model held inside a LightningModule, under every axis.

:mod:`.adapter` (``HuggingFaceAdapter``: what the engine asks, answered from the model's config and plans),
:mod:`.model` (finding the model, its causal-LM loss terms), one module per axis (:mod:`.tensor`, :mod:`.pipeline`,
:mod:`.context`, :mod:`.experts`), the decoder's glue between layers (:mod:`.chain`), the losses over the global batch
(:mod:`.loss`, :mod:`.router_loss`, :mod:`.router_pipeline`), per-layer initialisation on meta (:mod:`.init_weights`)
and transformers' style names (:mod:`.styles`).
"""

from lightning_parallel.adapters.hf.model import (
    IGNORE_INDEX,
    causal_lm_loss_terms,
    causal_lm_valid_count,
    find_hf_model,
    is_hf_model,
)

__all__ = ["IGNORE_INDEX", "causal_lm_loss_terms", "causal_lm_valid_count", "find_hf_model", "is_hf_model"]
