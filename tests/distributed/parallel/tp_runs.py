"""Rank functions for the tensor-parallel tests (module level, so spawn can pickle them).

Every rank also trains the single-process reference itself, before any sharding: on CPU
with one thread the reference is bit-for-bit what a separate one-process run gives, and
it saves a process launch per comparison.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from examples.nlp.model import GPT
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.grad_norm_clipping import clip_grad_norm_
from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel, loss_parallel_context, concrete_plan
from lightning_parallel.testing.models import OPTIMIZERS

VOCAB, SEQ, BATCH = 256, 16, 4


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layer=2, n_head=4, mlp_ratio=4, dropout=0.0).build()


def shard(model: torch.nn.Module, mesh, overrides: Any = None, **options: bool) -> None:
    """Resolve ``model``'s plan (``options``: sequence_parallel, loss_parallel) and apply it over ``mesh``, with the
    adapter resolved once as a strategy does."""
    adapter = adapt(model)
    apply_tensor_parallel(model, mesh, concrete_plan(model, overrides, **options, adapter=adapter), adapter)


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _scalar(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def train(
    model: GPT, optimizer_name: str, steps: int, clip: float, lp: bool, clip_fn=None
) -> tuple[list[float], list[float]]:
    """Losses and pre-clip gradient norms of ``steps`` raw training steps."""
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    losses, norms = [], []
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        with loss_parallel_context(lp):
            loss = model.pipeline_loss(model(inputs), targets)
            loss.backward()
        if clip_fn is None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            norm = clip_fn(model.parameters(), clip)
        optimizer.step()
        losses.append(_scalar(loss.detach()))
        norms.append(_scalar(norm))
    return losses, norms


def init(rank: int, world_size: int):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("tensor_parallel",))


def gpt_parity(
    mesh, cases: list[tuple[bool, bool, str, float]], steps: int, perturb: bool = False
) -> list[dict[str, Any]]:
    """For each (sequence_parallel, loss_parallel, optimizer, clip): TP vs reference losses and norms.

    ``perturb`` (the negative control) gives the last rank a different norm weight, as a
    custom norm init that was not broadcast would: SequenceParallel assumes replicas agree.
    """
    results = []
    for sp, lp, opt, clip in cases:
        reference = tiny_gpt()
        sharded = copy.deepcopy(reference)
        ref_losses, ref_norms = train(reference, opt, steps, clip, False)
        if perturb and dist.get_rank() == dist.get_world_size() - 1:
            with torch.no_grad():
                sharded.blocks["0"].ln1.weight.add_(0.1)
        shard(sharded, mesh, sequence_parallel=sp, loss_parallel=lp)
        losses, norms = train(sharded, opt, steps, clip, lp, clip_grad_norm_)
        results.append(
            dict(case=(sp, lp, opt, clip), losses=losses, ref_losses=ref_losses, norms=norms, ref_norms=ref_norms)
        )
    return results


def _count(counts: dict, name: str) -> int:
    return sum(v for k, v in counts.items() if name in str(k))


def gpt_collectives(mesh, cases: list[tuple[bool, bool, dict]]) -> list[dict[str, Any]]:
    """Collectives of one forward and backward of the tiny GPT, per (sequence_parallel, loss_parallel, overrides)."""
    from torch.distributed.tensor.debug import CommDebugMode

    out = []
    inputs, targets = batches(1)[0]
    for sp, lp, overrides in cases:
        model = tiny_gpt()
        shard(model, mesh, overrides, sequence_parallel=sp, loss_parallel=lp)
        with loss_parallel_context(lp):
            with CommDebugMode() as forward:
                loss = model.pipeline_loss(model(inputs), targets)
            with CommDebugMode() as backward:
                loss.backward()
        counts = {}
        for phase, mode in (("forward", forward), ("backward", backward)):
            c = mode.get_comm_counts()
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                counts[f"{phase}_{kind}"] = _count(c, kind)
        optimizer = torch.optim.AdamW(model.parameters())
        with CommDebugMode() as step:
            optimizer.step()
        counts["optimizer_step_total"] = step.get_total_counts()
        out.append(dict(case=(sp, lp, sorted(overrides)), counts=counts))
    return out


def parameter_bytes(mesh) -> dict[str, Any]:
    """Per-rank bytes of the sharded parameters against their unsharded size."""
    from torch.distributed.tensor import Shard

    model = tiny_gpt()
    full = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    shard(model, mesh, sequence_parallel=True)
    sharded, replicated = {}, {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            sharded[name] = nbytes
        else:
            replicated[name] = nbytes
    return dict(full=full, sharded=sharded, replicated=replicated)


PARITY_CASES = [
    (sp, lp, opt, clip)
    for sp in (False, True)
    for lp in (False, True)
    for opt, clip in (("adamw", 0.5), ("sgd", float("inf")))
]
COLLECTIVE_CASES = [
    (False, False, {}),
    (False, True, {}),
    (True, False, {}),
    (True, True, {}),
    # Without gather_input on attn, q/k/v each all-reduce their input gradient.
    (False, False, {"blocks.*.attn": None}),
    # A plan that leaves the MLPs replicated: the count must change.
    (False, False, {"blocks.*.mlp": None, "blocks.*.mlp.up": None, "blocks.*.mlp.down": None}),
]


def tp_checks(rank: int, world_size: int, steps: int, negative_control: bool) -> dict[str, Any]:
    """Everything the distributed tests assert, in one launch per world size."""
    mesh = init(rank, world_size)
    out = dict(
        parity=gpt_parity(mesh, PARITY_CASES, steps),
        collectives=gpt_collectives(mesh, COLLECTIVE_CASES),
        bytes=parameter_bytes(mesh),
    )
    if negative_control:
        out["perturbed"] = gpt_parity(mesh, [(True, False, "adamw", 0.5)], steps, perturb=True)
    return out
