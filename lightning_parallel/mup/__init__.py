"""μP (maximal update parametrisation, Yang et al., Tensor Programs V): what a model's width changes.

A model tuned at ``base_width`` keeps its best learning rate at any ``width`` when its hidden (matrix-like)
weights are initialised with std x ``sqrt(base_width / width)`` and trained at lr x ``base_width / width``, its
logits are multiplied by ``base_width / width`` and its attention scores are scaled by ``1 / d_head``;
embeddings, norms and biases keep the base learning rate and initialisation. :mod:`.width` holds the arithmetic,
:mod:`.groups` the optimizer's parameter groups. The recipes apply it (``examples/nlp/model.py``, and for Hugging
Face decoders :mod:`lightning_parallel.adapters.hf.mup`); ``scaling=mup`` with ``model.base_width`` turns it on.
"""

from lightning_parallel.mup.groups import check_mup_optimizer, full_ndim, mup_optimizer, mup_roles
from lightning_parallel.mup.width import ROLES, MupWidth

__all__ = ["ROLES", "MupWidth", "check_mup_optimizer", "full_ndim", "mup_optimizer", "mup_roles"]
