"""The pre-norm transformer block shared by the GPT (causal) and ViT (bidirectional) recipes.

Note:
    * Submodule names (``ln1``, ``attn.q/k/v/out``, ``ln2``, ``mlp.up/down``) are what the
      recipes' ``tensor_parallel_plan()`` globs and checkpoints name; keep them stable.
    * Attention reshapes with ``-1`` heads, so a tensor-parallel rank holding a column
      slice of q/k/v computes its own heads unchanged.
    * The attention itself is a parameter-free submodule (``attn.core``,
      :class:`DotProductAttention`): context parallelism replaces exactly that module by one that sees
      the other ranks' keys, which a recipe names in its ``context_parallel_plan()``.
    * The projections are made by ``linear(in_features, out_features)`` (``nn.Linear`` by default): a
      recipe passes a Linear whose ``reset_parameters()`` is its initialisation scheme
      (:class:`examples.building.NormalLinear`), which is what initialises each layer after a build on
      ``meta``. Initial values depend on the run's seed and the module names, not on creation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

Linear = Callable[[int, int], nn.Module]  # (in_features, out_features) -> a Linear


class DotProductAttention(nn.Module):
    """``softmax(q k^T x scale) v`` over ``[batch, heads, seq, head_dim]`` tensors (torch's SDPA).

    Args:
        is_causal: mask attention to earlier positions.
        dropout: dropout on the attention weights (training only).
        num_heads: heads of the whole layer (what a split over heads checks before it starts).
        scale: the scores' scale; None is ``1 / sqrt(head_dim)`` (μP passes its ``1 / d_head``; context parallelism
            keeps it).
    """

    def __init__(self, is_causal: bool, dropout: float, num_heads: int, scale: Optional[float] = None) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.dropout = dropout
        self.num_heads = num_heads
        self.scale = scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal, dropout_p=p, scale=self.scale)


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (shardable by heads).

    Args:
        d_model: token width.
        n_head: attention heads (must divide ``d_model``).
        dropout: dropout on the attention weights and on the output.
        causal: mask attention to earlier positions (a decoder) or not (an encoder).
        linear: makes the projections (``nn.Linear``).
        attention_scale: the scores' scale (None: ``1 / sqrt(head_dim)``).
    """

    def __init__(self, d_model: int, n_head: int, dropout: float, causal: bool, linear: Linear = nn.Linear,
                 attention_scale: Optional[float] = None) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.causal = causal
        self.q = linear(d_model, d_model)
        self.k = linear(d_model, d_model)
        self.v = linear(d_model, d_model)
        self.out = linear(d_model, d_model)
        self.core = DotProductAttention(causal, dropout, n_head, attention_scale)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # -1 instead of n_head: under tensor parallelism a rank holds only its share of heads.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = self.core(q, k, v).transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_drop(self.out(y))


class MLP(nn.Module):
    """Two-layer GELU feed-forward network.

    Args:
        d_model: token width (input and output).
        hidden: hidden width.
        dropout: dropout on the output.
        linear: makes the two layers (``nn.Linear``).
    """

    def __init__(self, d_model: int, hidden: int, dropout: float, linear: Linear = nn.Linear) -> None:
        super().__init__()
        self.up = linear(d_model, hidden)
        self.down = linear(hidden, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Args:
        d_model: token width.
        n_head: attention heads (must divide ``d_model``).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout probability in attention and MLP.
        causal: causal attention (decoder) or bidirectional (encoder).
        linear: makes the attention and MLP projections (``nn.Linear``).
        mlp: the feed-forward module in place of the dense :class:`MLP` (a mixture of experts), still named
            ``mlp``; None builds the dense one.
        attention_scale: the attention scores' scale (None: ``1 / sqrt(head_dim)``).
    """

    def __init__(
        self, d_model: int, n_head: int, mlp_ratio: int, dropout: float, causal: bool, linear: Linear = nn.Linear,
        mlp: nn.Module | None = None, attention_scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_head, dropout, causal, linear, attention_scale)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio * d_model, dropout, linear) if mlp is None else mlp

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
