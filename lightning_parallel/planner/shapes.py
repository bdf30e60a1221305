"""What the planner knows of a model: its pipeline layers' parameters, FLOPs, activations and sharding limits.

A :class:`ModelShape` comes from an instantiated module (:mod:`lightning_parallel.planner.profile`,
exact parameters and a measured micro-batch per layer) or from published dimensions
(:func:`llama3_shape`, analytic, for plans at a scale this machine cannot instantiate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional


@dataclass(frozen=True)
class Param:
    """One parameter tensor.

    Args:
        shape: its global shape.
        tp_dim: the dimension tensor parallelism shards (None: replicated on the tensor group).
        expert: whether it holds a mixture-of-experts layer's experts along dimension 0 (what expert
            parallelism divides, and then leaves out of FSDP2).
    """

    shape: tuple[int, ...]
    tp_dim: Optional[int] = None
    expert: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerShape:
    """One pipeline layer, per sample of one micro-batch.

    Args:
        name: the layer's name.
        params: its parameters.
        fwd_flops: forward FLOPs per sample (backward counts twice that).
        activation_sharded: bytes saved for backward per sample that tensor parallelism divides.
        activation_replicated: bytes saved for backward per sample every tensor rank keeps whole.
        output_bytes: bytes per sample of the layer's output (a pipeline send; what full checkpointing keeps).
        tp_all_reduce_bytes: bytes per sample all-reduced over the tensor group in forward (the same again in
            backward): one output-sized tensor per row-parallel matrix.
        tp_collectives: tensor-group collective calls per forward + backward (each pays the link's latency).
        recompute_fraction: share of the forward time selective checkpointing spends recomputing.
        selective_saved: share of the activations selective checkpointing still keeps (None: not known, and
            selective checkpointing is not planned for this layer).
        attention_modules: attention modules in the layer, each over the whole sequence (what context
            parallelism replaces, and where its ring or all-to-all traffic happens).
        moe_modules: mixture-of-experts modules in the layer (where expert parallelism's all-to-alls happen).
    """

    name: str
    params: tuple[Param, ...]
    fwd_flops: float
    activation_sharded: float
    activation_replicated: float
    output_bytes: float
    tp_all_reduce_bytes: float = 0.0
    tp_collectives: int = 0
    recompute_fraction: float = 0.0
    selective_saved: Optional[float] = None
    attention_modules: int = 0
    moe_modules: int = 0

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def expert_params(self) -> int:
        """Elements of the layer's experts (all ``E`` of every MoE module)."""
        return sum(p.numel for p in self.params if p.expert)


@dataclass(frozen=True)
class AttentionShape:
    """The attention a context group splits: one sample's sequence and the heads each attention module has.

    Args:
        seq_len: tokens per sample (a context size must cut it into ``2 x cp`` equal chunks).
        q_heads: query heads of the whole model (before tensor parallelism).
        kv_heads: key/value heads (``q_heads`` without grouped-query attention).
        head_dim: elements per head (of queries, keys and values alike).
        act_bytes: bytes per element of q, k, v and the attention output (what a context group sends).
    """

    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    act_bytes: int = 4


@dataclass(frozen=True)
class ExpertShape:
    """The experts expert parallelism splits: the same in every MoE module of the model.

    Args:
        num_experts: ``E``, experts per MoE module (an expert size must divide it).
        top_k: experts each token goes to.
        d_model: elements of a token's hidden state (what dispatch and combine send per token copy).
        hidden: hidden width of one expert.
        tokens_per_sample: tokens of one sample reaching each MoE module.
        expert_params: elements of one expert (its matrices together): a token copy costs ``2 x`` that in FLOPs.
        act_bytes: bytes per element of the hidden states sent.
    """

    num_experts: int
    top_k: int
    d_model: int
    hidden: int
    tokens_per_sample: int
    expert_params: int
    act_bytes: int = 4


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it.

    Args:
        name: what to call it in tables.
        layers: the pipeline layers in order.
        tp_divides: ``(what, size)`` pairs a tensor-parallel size must divide (heads, widths, vocabulary).
        param_bytes: bytes per parameter element (4: fp32 master weights).
        optimizer_states: optimizer state tensors per parameter (2 for Adam/AdamW).
        measured_seconds: ``f(micro_batch) -> forward+backward seconds of each layer`` on this machine, or None.
        source: how the shape was obtained (shown in tables).
        built_on_meta: whether the run builds the model on the ``meta`` device (in ``configure_model``: each rank
            then allocates only its share) rather than with storage (in ``__init__``: every rank holds the whole
            model before the split). Decides the setup peak (:func:`~lightning_parallel.planner.memory.setup_bytes`).
        attention: the sequence and heads context parallelism splits (None: no attention the module's
            ``context_parallel_plan()`` names, and no context-parallel candidates).
        experts: the experts expert parallelism splits (None: no experts module the module's
            ``expert_parallel_plan()`` names, and no expert-parallel candidates).
        split_refusals: ``(axis, reason)`` for each of ``data``, ``pipeline``, ``context`` whose split of the batch
            the model refuses at start-up (its ``check_batch_split``: a balancing loss formed in ``training_step``).
        step_bytes: bytes of the step counter the optimizer keeps per parameter tensor (Adam/AdamW: a float32
            scalar; 0: none), measured by ``lp-simulate`` as part of the optimizer state.
    """

    name: str
    layers: tuple[LayerShape, ...]
    tp_divides: tuple[tuple[str, int], ...] = ()
    param_bytes: int = 4
    optimizer_states: int = 2
    measured_seconds: Optional[Callable[[int], Sequence[float]]] = field(default=None, compare=False, repr=False)
    source: str = "analytic"
    built_on_meta: bool = True
    attention: Optional[AttentionShape] = None
    experts: Optional[ExpertShape] = None
    split_refusals: tuple[tuple[str, str], ...] = ()
    step_bytes: int = 4

    @property
    def num_params(self) -> int:
        return sum(layer.num_params for layer in self.layers)

    @cached_property
    def _counts(self) -> tuple[int, ...]:
        return tuple(layer.num_params for layer in self.layers)

    def parameter_counts(self) -> list[int]:
        """Parameter elements per layer (what ``partition='parameters'`` balances)."""
        return list(self._counts)

    @cached_property
    def _local_cache(self) -> dict[tuple[int, int, int], tuple[tuple[int, int], ...]]:
        return {}

    def local_counts(self, tp: int, fsdp: int, ep: int = 1, expert_data: int = 1) -> tuple[tuple[int, int], ...]:
        """Per layer: (elements a tensor rank holds, elements the first FSDP shard of that holds) for ``tp`` and
        ``fsdp`` (1: no FSDP). FSDP2 cuts dim 0 as tensor parallelism left it, rounding up (``torch.chunk``).

        Under expert parallelism (``ep > 1``) a rank holds ``E / ep`` experts whole: FSDP2 leaves them out (their
        gradients are reduced over the expert-data group instead), unless they are sharded over their
        ``expert_data`` ranks (``expert_data_shard``): FSDP2 then cuts their dim 1, rounding up. With ``ep = 1``
        they are ordinary parameters.
        """
        key = (tp, fsdp, ep, expert_data)
        if key not in self._local_cache:
            rows = []
            for layer in self.layers:
                tp_local = shard = 0
                for p in layer.params:
                    dims = list(p.shape)
                    if tp > 1 and p.tp_dim is not None:
                        dims[p.tp_dim] //= tp
                    if p.expert and ep > 1:
                        held = math.prod(dims) // ep
                        tp_local += held
                        if expert_data > 1 and len(dims) > 1:
                            held = held // dims[1] * -(-dims[1] // expert_data)
                        shard += held
                        continue
                    tp_local += math.prod(dims)
                    dims[0] = -(-dims[0] // fsdp)
                    shard += math.prod(dims)
                rows.append((tp_local, shard))
            self._local_cache[key] = tuple(rows)
        return self._local_cache[key]

    def expert_counts(self, ep: int = 1) -> tuple[int, ...]:
        """Per layer: expert elements a rank of an expert group of ``ep`` holds (``E / ep`` of every MoE module's)."""
        return tuple(layer.expert_params // ep for layer in self.layers)


def _block(i: int, h: int, heads: int, kv_heads: int, ffn: int, s: int, act_bytes: int) -> LayerShape:
    """One Llama decoder block (RMSNorm, GQA attention with flash attention, SwiGLU MLP)."""
    head_dim = h // heads
    kv = kv_heads * head_dim
    params = (
        Param((h,)), Param((h, h), 0), Param((kv, h), 0), Param((kv, h), 0), Param((h, h), 1),
        Param((h,)), Param((ffn, h), 0), Param((ffn, h), 0), Param((h, ffn), 1),
    )
    matmul = sum(p.numel for p in params if len(p.shape) == 2)
    attention = 4 * s * s * h  # QK^T and AV, 2 FLOPs per multiply-add
    # Saved for backward (Korthikanti et al. 2022, adapted to GQA + SwiGLU, flash attention keeps no s^2 scores):
    # replicated: both norm inputs and the two matmul inputs after them; sharded: q, k, v, attention output,
    # and the four ffn-wide tensors of SwiGLU.
    replicated = act_bytes * s * 4 * h
    sharded = act_bytes * s * (2 * h + 2 * kv + 4 * ffn)
    # Selective (op-level: matmul and fused-attention outputs kept) recomputes the norms and SwiGLU's silu and
    # product: it keeps the two norm inputs, q, k, v, the attention output and the w1 / w3 outputs.
    kept = act_bytes * s * (2 * h + 2 * h + 2 * kv + 2 * ffn)
    return LayerShape(
        name=f"layers.{i}", params=params, fwd_flops=2 * matmul * s + attention,
        activation_sharded=sharded, activation_replicated=replicated, output_bytes=act_bytes * s * h,
        tp_all_reduce_bytes=2 * act_bytes * s * h, tp_collectives=4,
        recompute_fraction=0.05,  # elementwise ops, memory-bound
        selective_saved=kept / (replicated + sharded), attention_modules=1,
    )


LLAMA3 = {
    # hidden, layers, heads, kv heads, ffn hidden, vocabulary (Meta's params.json of Llama 3 / 3.1)
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256),
}


def llama3_shape(name: str, seq_len: int = 8192, act_bytes: int = 2) -> ModelShape:
    """Llama 3 8B or 70B from its published dimensions (no weights), bf16 activations.

    Args:
        name: ``llama3-8b`` or ``llama3-70b``.
        seq_len: tokens per sample.
        act_bytes: bytes per activation element (2: bf16).
    """
    if name not in LLAMA3:
        raise ValueError(f"Unknown shape {name!r}: use one of {sorted(LLAMA3)}.")
    h, n, heads, kv_heads, ffn, vocab = LLAMA3[name]
    s = seq_len
    embed = LayerShape("tok_embeddings", (Param((vocab, h), 0),), fwd_flops=0.0, activation_sharded=0.0,
                       activation_replicated=0.0, output_bytes=act_bytes * s * h, tp_all_reduce_bytes=act_bytes * s * h)
    head = LayerShape("norm+output", (Param((h,)), Param((vocab, h), 0)), fwd_flops=2 * vocab * h * s,
                      activation_sharded=4 * s * vocab, activation_replicated=act_bytes * s * 2 * h,
                      output_bytes=4 * s * vocab)
    blocks = tuple(_block(i, h, heads, kv_heads, ffn, s, act_bytes) for i in range(n))
    return ModelShape(name, (embed, *blocks, head), tp_divides=(("query heads", heads), ("kv heads", kv_heads),
                      ("ffn hidden", ffn), ("vocabulary", vocab)), source=f"analytic (seq {s}, bf16 activations)",
                      attention=AttentionShape(s, heads, kv_heads, h // heads, act_bytes))
