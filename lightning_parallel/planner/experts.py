"""The expert axis in the planner: which expert sizes a model allows, what an expert rank holds and what it sends.

Expert parallelism (:mod:`lightning_parallel.parallel.experts`) borrows ``ep`` of the data x context ranks of one
(pipeline, tensor) position: each holds ``E / ep`` experts of every MoE module, and the token copies travel to the
rank holding their expert by all-to-all and back. What the planner charges, per rank:

* Memory: parameters, gradients and optimizer state of ``E / ep`` experts. In the current implementation FSDP2
  leaves the expert slices out (ZeRO 2/3 shard the dense parameters only), so the expert states are *not* divided
  by the expert-data group (the ``dp x cp / ep`` ranks holding the same experts). With ``ep = 1`` the experts are
  ordinary parameters, which ZeRO shards. Saved activations do not change: a rank sends as many token copies as it
  receives when the router is uniform.
* Bytes: per MoE module and micro-batch, a rank of ``T`` tokens (``b x S / cp``: context ranks hold ``1 / cp`` of
  each sequence; tensor peers each send their own copy) routes ``T x k`` token copies of ``d`` elements of ``e``
  bytes. Assuming a *uniform router*, ``(ep - 1) / ep`` of them leave the rank. Dispatch and combine in forward,
  and both again in backward (their gradients), each send that::

      dispatch = combine = (ep - 1) / ep * T k d e          forward = backward = 2 x dispatch

  Activation checkpointing recomputes the forward, its dispatch and combine included (once more per step). A
  skewed router sends more from the ranks whose tokens prefer remote experts (``benchmarks/expert_parallel.py``
  compares counted bytes with this formula).
* Time, alpha-beta on the link the expert group spans (``ep`` consecutive data x context positions, ranks placed
  tensor-innermost then pipeline: ``ep x pp x tp`` ranks): an all-to-all of which ``X`` bytes leave a rank costs
  ``(ep - 1) alpha + X / beta_a2a`` (the cluster's all-to-all bandwidth). Forward makes three all-to-alls (the
  token counts, then dispatch and combine), backward two. Expert gradients are all-reduced once per optimizer step
  over the expert-data group (``dp x cp / ep`` ranks) instead of over data x context.

Note:
    Expert compute per rank is the one-process figure under a uniform router (``T k`` copies through ``E / ep``
    experts instead of through ``E``); tensor parallelism does not divide it (the MoE blocks keep their router and
    experts whole on every tensor rank).
"""

from __future__ import annotations

from typing import Optional

from lightning_parallel.planner.cluster import Link
from lightning_parallel.planner.context import Traffic
from lightning_parallel.planner.shapes import ExpertShape, ModelShape

FORWARD_ALL_TO_ALLS = 3  # token counts, dispatch, combine
BACKWARD_ALL_TO_ALLS = 2  # the gradients of combine and dispatch


def size_reason(shape: ModelShape, ep: int) -> Optional[str]:
    """Why ``ep`` expert ranks cannot split ``shape``'s experts (None: they can).

    Args:
        shape: the model.
        ep: the expert-parallel size (> 1).
    """
    if shape.experts is None:
        return (f"no experts to split: {shape.name} names no experts module (expert_parallel_plan()), so expert "
                "parallelism has nothing to shard")
    experts = shape.experts.num_experts
    if experts % ep:
        divisors = [n for n in range(1, experts + 1) if experts % n == 0]
        return (f"experts do not split: expert_parallel_size={ep} does not divide num_experts={experts}: use a size "
                f"among {divisors}")
    return None


def copy_bytes(experts: ExpertShape, tokens: float) -> float:
    """Bytes of the hidden states of ``tokens`` tokens' ``top_k`` copies (what one dispatch moves, all of it)."""
    return tokens * experts.top_k * experts.d_model * experts.act_bytes


def sent_bytes(experts: ExpertShape, ep: int, tokens: float) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends for one MoE module on ``tokens`` of its tokens (module docstring).

    Args:
        experts: the model's experts.
        ep: the expert-parallel size (1: nothing).
        tokens: the rank's tokens in the micro-batch (``samples x tokens_per_sample / cp``).
    """
    one = (ep - 1) / ep * copy_bytes(experts, tokens)  # dispatch, or combine, under a uniform router
    return 2 * one, 2 * one


def traffic(experts: ExpertShape, ep: int, tokens: float, link: Link) -> Traffic:
    """Bytes and seconds of one MoE module's all-to-alls on ``tokens`` of a rank's tokens, on ``link``.

    Args:
        experts: the model's experts.
        ep: the expert-parallel size.
        tokens: the rank's tokens in the micro-batch.
        link: the link the expert group talks over.
    """
    if ep == 1:
        return Traffic(0.0, 0.0, 0.0, 0.0)
    forward, backward = sent_bytes(experts, ep, tokens)
    a2a = link.all_to_all_bandwidth
    return Traffic(forward, backward, FORWARD_ALL_TO_ALLS * (ep - 1) * link.latency + forward / a2a,
                   BACKWARD_ALL_TO_ALLS * (ep - 1) * link.latency + backward / a2a)


def expert_flops_share(shape: ModelShape, layer: int) -> float:
    """The share of ``layer``'s forward FLOPs its experts compute (what tensor parallelism does not divide).

    Args:
        shape: the model.
        layer: the layer's index.
    """
    s, experts = shape.layers[layer], shape.experts
    if experts is None or not s.moe_modules or s.fwd_flops <= 0:
        return 0.0
    flops = s.moe_modules * 2 * experts.tokens_per_sample * experts.top_k * experts.expert_params
    return min(1.0, flops / s.fwd_flops)
