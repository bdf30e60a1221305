"""The context axis in the planner: which context sizes a model allows, and what its context group sends.

A context rank holds ``s = S / cp`` of every sample's ``S`` tokens (head-tail chunks), so its compute, its
saved activations and its pipeline and tensor-parallel messages are ``1 / cp`` of one replica's. Attention
is what talks. Per rank, per attention module, per micro-batch of ``b`` samples, with ``H`` query and ``G``
key/value heads of ``d`` elements split over ``tp`` tensor ranks, ``e`` bytes per activation element and
``f = max(e, 4)`` bytes per gradient accumulator (the ring accumulates in float32 at least):

* ring (:mod:`lightning_parallel.parallel.context.ring`): a key/value block is ``kv = 2 b (G/tp) s d e``.
  Forward sends it ``cp - 1`` times; backward sends it ``cp - 1`` times again, and the dK/dV accumulators
  (``dkv = 2 b (G/tp) s d f``) ``cp`` times (they follow their block around the ring and come home)::

      ring_forward = (cp - 1) kv          ring_backward = (cp - 1) kv + cp dkv

* Ulysses (:mod:`lightning_parallel.parallel.context.ulysses`): four all-to-alls forward (q, k, v to head
  shards, the output back) and four in backward (their gradients); an all-to-all of a ``[b, h, s, d]``
  tensor keeps ``1 / cp`` of it and sends the rest. k and v are repeated to the query heads first when
  ``G / tp`` does not divide by ``cp`` (``G' = H``, else ``G' = G``)::

      ulysses_forward = ulysses_backward = (cp - 1) / cp * b s d e * (2 H + 2 G') / tp

Activation checkpointing recomputes the forward, its context messages included (once more per step).

Time, alpha-beta on the link the context group spans (ranks are placed tensor-innermost, then pipeline, then
context: a group spans ``cp x pp x tp`` ranks): a ring rotation costs ``alpha + block / beta`` (send/recv
bandwidth), an all-to-all of ``X`` bytes per rank ``(cp - 1) (alpha + X / (cp beta_a2a))``.

Note:
    The ring posts each transfer before computing the current block, so on a device with a copy engine the
    transfer hides behind the block's attention. The planner charges it in full (not overlapped): on gloo the
    send/recv runs on the same cores, and the ranking stays conservative where overlap is not reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_parallel.planner.cluster import Link
from lightning_parallel.planner.shapes import AttentionShape, ModelShape

METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class Traffic:
    """What one attention module's context collectives cost one rank on one micro-batch.

    Args:
        forward_bytes: bytes sent in forward. backward_bytes: bytes sent in backward.
        forward_seconds: seconds of forward collectives. backward_seconds: of backward collectives.
    """

    forward_bytes: float
    backward_bytes: float
    forward_seconds: float
    backward_seconds: float


def size_reason(shape: ModelShape, cp: int) -> Optional[str]:
    """Why ``cp`` context ranks cannot split ``shape``'s sequences (None: they can).

    Args:
        shape: the model.
        cp: the context size (> 1).
    """
    if shape.attention is None:
        return (f"no attention to split: {shape.name} names no attention module (context_parallel_plan()), so "
                "context parallelism has nothing to run across ranks")
    from lightning_parallel.parallel.context.sharding import check_sequence

    try:
        check_sequence(shape.attention.seq_len, cp)
    except ValueError as error:
        return f"sequence does not split: {error}"
    return None


def method_reason(attention: AttentionShape, method: str, cp: int, tp: int) -> Optional[str]:
    """Why ``method`` cannot run ``cp`` context ranks under ``tp`` tensor ranks (None: it can): Ulysses splits the
    query heads a tensor rank holds over the context ranks.

    Args:
        attention: the model's attention.
        method: ``ring`` or ``ulysses``.
        cp: the context size. tp: the tensor size.
    """
    if method == "ring":
        return None
    from lightning_parallel.parallel.context.ulysses import check_heads

    try:
        check_heads(attention.q_heads, attention.kv_heads, cp, tp)
    except ValueError as error:
        return f"heads do not split: {error}"
    return None


def sent_bytes(attention: AttentionShape, method: str, cp: int, tp: int, samples: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for one attention module on ``samples`` samples (module docstring).

    Args:
        attention: the model's attention.
        method: ``ring`` or ``ulysses``.
        cp: the context size (1: nothing). tp: the tensor size.
        samples: samples in the micro-batch.
    """
    if cp == 1:
        return 0.0, 0.0
    a = attention
    local = samples * (a.seq_len // cp) * a.head_dim  # elements per head of this rank's tokens
    kv_heads = a.kv_heads / tp
    if method == "ring":
        kv = 2 * local * kv_heads * a.act_bytes
        dkv = 2 * local * kv_heads * max(a.act_bytes, 4)
        return (cp - 1) * kv, (cp - 1) * kv + cp * dkv
    q_heads = a.q_heads / tp
    kv_sent = kv_heads if (a.kv_heads // tp) % cp == 0 else q_heads
    volume = (cp - 1) / cp * local * a.act_bytes * (2 * q_heads + 2 * kv_sent)
    return volume, volume


def traffic(attention: AttentionShape, method: str, cp: int, tp: int, samples: int, link: Link) -> Traffic:
    """Bytes and seconds of one attention module's context collectives on one micro-batch, on ``link``.

    Args:
        attention: the model's attention.
        method: ``ring`` or ``ulysses``.
        cp: the context size. tp: the tensor size.
        samples: samples in the micro-batch.
        link: the link the context group talks over.
    """
    forward, backward = sent_bytes(attention, method, cp, tp, samples)
    if cp == 1:
        return Traffic(0.0, 0.0, 0.0, 0.0)
    if method == "ring":
        kv = forward / (cp - 1)
        dkv = (backward - forward) / cp
        step = link.latency + kv / link.bandwidth
        return Traffic(forward, backward, (cp - 1) * step,
                       (cp - 1) * step + cp * (link.latency + dkv / link.bandwidth))
    # Four all-to-alls each way; together they move ``forward`` bytes in 4 (cp - 1) messages.
    seconds = 4 * (cp - 1) * link.latency + forward / link.all_to_all_bandwidth
    return Traffic(forward, backward, seconds, seconds)
