"""How the recipes build their layers: in ``configure_model``, on the ``meta`` device under the suite's strategies.

Note:
    * Under the suite's strategies ``configure_model`` runs on ``meta`` and each rank allocates only its share;
      every module that owns tensors is then initialised on its own by its ``reset_parameters()``, from a
      random stream seeded by (the run's seed, the module's name) (:mod:`lightning_parallel.protocol`). So a
      recipe's initialisation scheme lives in its layers' ``reset_parameters()``: :class:`NormalLinear`,
      :class:`NormalEmbedding`, or a module's own for a parameter it holds directly.
    * Built with storage (Lightning's own strategies, one device, no Trainer), :func:`seed_built_model` gives
      the model the same values, so every strategy starts from identical weights.
    * Under DeepSpeed ZeRO-3 ``configure_model`` runs inside ``deepspeed.zero.Init``: parameters are
      partitioned as they are created, and each module is gathered while it is initialised.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

Built = TypeVar("Built", bound="BuildsInConfigureModel")


class NormalLinear(nn.Linear):
    """``nn.Linear`` whose ``reset_parameters()`` draws the weight from N(0, ``std``) and zeroes the bias.

    Args:
        in_features: input width.
        out_features: output width.
        bias: whether it has a bias.
        std: standard deviation of the weight.
        truncated: draw with ``nn.init.trunc_normal_`` (cut at +-2) instead of ``nn.init.normal_``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, std: float = 0.02,
                 truncated: bool = False, device: Any = None, dtype: Any = None) -> None:
        self.std, self.truncated = std, truncated  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        draw = nn.init.trunc_normal_ if self.truncated else nn.init.normal_
        draw(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormalEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``reset_parameters()`` draws the table from N(0, ``std``).

    Args:
        num_embeddings: rows.
        embedding_dim: width.
        std: standard deviation of the table.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, std: float = 0.02, device: Any = None,
                 dtype: Any = None) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned ``module``'s parameters as they were created (``deepspeed.zero.Init``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def seed_built_model(module: nn.Module) -> bool:
    """Give a model just built with storage the initial values the suite gives it on ``meta`` under any layout.

    Every module owning tensors is initialised alone (``reset_parameters()``; a Hugging Face model's own
    ``_init_weights`` inside it), seeded by ``(torch.initial_seed(), its name)``:
    :func:`lightning_parallel.protocol.seeded_init` with the initialiser of the model's adapter (which gathers
    parameters DeepSpeed ZeRO-3 partitioned, one module at a time).

    Args:
        module: the LightningModule, right after its layers were created.

    Returns:
        False, doing nothing, when the model is on ``meta`` (the strategy initialises each rank's share).
    """
    tensors = [*module.parameters(), *module.buffers()]
    if not tensors or any(t.is_meta for t in tensors):
        return False
    from lightning_parallel.adapters import adapt
    from lightning_parallel.protocol import seeded_init

    seeded_init(module, torch.initial_seed(), adapt(module).init_module)
    return True


class BuildsInConfigureModel:
    """Mixin of the recipes: layers are created in ``configure_model()``; :meth:`build` does it without a Trainer."""

    def build(self: Built) -> Built:
        """Create the layers now, with storage and the seeded initial values (for use without a Trainer).

        Returns:
            The module itself, so ``GPT(...).build()`` reads as one expression.
        """
        self.configure_model()  # type: ignore[attr-defined]  # the LightningModule's, as the recipe defines it
        return self
