"""The GPT recipe's parts around its blocks: the token embedding, the LM head, and what μP calls each parameter.

Every weight and embedding starts from N(0, :data:`STD`) and every bias from zero; under μP (``base_width``) the
blocks' matrices start from N(0, ``STD x sqrt(base_width / width)``) and the head multiplies its logits by
``base_width / width`` (:mod:`lightning_parallel.mup`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_parallel.mup import full_ndim

from ..building import NormalEmbedding, NormalLinear

STD = 0.02  # every weight and embedding: N(0, STD); biases zero


class TokenPositions(nn.Module):
    """The positions ``0..seq-1`` of a batch's tokens (a module so that context parallelism, where a rank
    holds a share of each sequence, can name it in ``context_parallel_plan()`` and give global positions)."""

    def forward(self, idx: Tensor) -> Tensor:
        return torch.arange(idx.shape[1], device=idx.device)


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding, then dropout."""

    def __init__(self, vocab_size: int, d_model: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.tok = NormalEmbedding(vocab_size, d_model, std=STD)
        self.pos = NormalEmbedding(seq_len, d_model, std=STD)
        self.positions = TokenPositions()
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        return self.drop(self.tok(idx) + self.pos(self.positions(idx)))


class LMHead(nn.Module):
    """Final norm and projection to vocabulary logits, times ``output_multiplier`` (μP's ``base_width / width``).

    Args:
        d_model: the residual width.
        vocab_size: the number of logits.
        output_multiplier: what the logits are multiplied by (1: the standard parametrisation).
    """

    def __init__(self, d_model: int, vocab_size: int, output_multiplier: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = NormalLinear(d_model, vocab_size, bias=False, std=STD)
        self.output_multiplier = output_multiplier

    def forward(self, x: Tensor) -> Tensor:
        logits = self.proj(self.norm(x))
        return logits if self.output_multiplier == 1.0 else logits * self.output_multiplier


def mup_role(name: str, param: Tensor) -> str:
    """The GPT recipe's parameter ``name`` to μP (:data:`lightning_parallel.mup.ROLES`): the embeddings are its
    input, the head's projection its output, the blocks' matrices hidden, norms and biases vectors.

    Args:
        name: the parameter's name in the model (every layout keeps it).
        param: the parameter (its full dimensions count, not a shard's).
    """
    if name.startswith("embed."):
        return "input"
    if name.startswith("head.proj."):
        return "output"
    return "hidden" if name.startswith("blocks.") and full_ndim(param) >= 2 else "vector"
