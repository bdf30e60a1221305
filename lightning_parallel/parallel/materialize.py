"""Step 7 of :func:`~lightning_parallel.parallel.compose.parallelize`: a model built on the ``meta`` device becomes
this rank's share only, initialised to the values every other layout (one process included) gives it.

A model built on ``meta`` (``configure_model`` under the suite's strategies, or ``trainer.init_module(
empty_init=True)``) holds shapes and no storage. :func:`parallelize` splits, shards and wraps it while
it is still on ``meta``; then :func:`materialize` allocates what this rank holds (``to_empty``: the
pipeline stages it owns, its tensor-parallel slices, its FSDP2 shards) and fills it.

Initialisation equal across layouts: each module that owns parameters or buffers directly is
initialised *on its own*, at full size on the CPU, from a random stream seeded by ``(seed, the module's
name in the unsplit model)``; this rank copies the slice it holds and drops the rest. So the initial
weights depend on the seed and the names only -- never on the layout, the rank or the order in which
ranks reach a layer -- and the peak memory of the step is one module's full size (the largest embedding),
not the model's. Tied parameters take the value of their first name (``embed_tokens.weight`` for a tied
LM head), also on a pipeline stage that holds only the head.

Note:
    This is torchtitan's "seed checkpoint" made unnecessary: rather than writing the whole initial model
    once and reading it back through DCP, every rank recomputes the few modules it holds (a CPU cost of
    one forward-sized pass over those modules' initialisers, no disk, no process that holds the whole
    model). The values differ from an eager ``torch.manual_seed(s); Model()`` (whose RNG stream runs
    through the whole model in construction order); ``protocol.seeded_init`` gives an eagerly built model the
    same values (:func:`lightning_parallel.protocol.seeded_init`), for code that builds eagerly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_parallel.parallel.tensor.ties import restore_ties, tie_groups
from lightning_parallel.protocol import InitFn, layer_seed, owned_tensors, reset_parameters


@dataclass(frozen=True)
class Materialization:
    """Where and from which seed a model built on ``meta`` gets its storage (:func:`materialize`).

    Attributes:
        device: this rank's device.
        seed: the run's seed, the same on every rank (the strategy broadcasts rank 0's).
    """

    device: torch.device
    seed: int


@dataclass
class InitPlan:
    """Where each tensor's initial value comes from, recorded on the unsplit ``meta`` model.

    Attributes:
        seed: the run's seed (the same on every rank).
        sources: ``{tensor name: (owner module name, attribute)}`` for every parameter and buffer name,
            tied aliases pointing at their first name's owner.
        templates: ``{owner module name: a meta copy of that module}``, initialised at full size on demand.
    """

    seed: int
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    templates: dict[str, nn.Module] = field(default_factory=dict)


def plan_initialisation(module: nn.Module, seed: int, init: InitFn = reset_parameters) -> InitPlan:
    """Record, before any split, which module initialises each tensor of ``module`` (built on ``meta``).

    Every owner's initialiser is tried once on its ``meta`` copy here, so a module that cannot be
    initialised is refused before anything is allocated or any rank diverges.

    Args:
        module: the whole model on the ``meta`` device.
        seed: the run's seed, the same on every rank.
        init: the adapter's initialiser (:func:`reset_parameters` for the protocol).

    Raises:
        ValueError: a module owns tensors that ``init`` cannot initialise (named, with the fix).
    """
    stored = sorted({name for name, t in [*module.named_parameters(), *module.named_buffers()] if not t.is_meta})
    if stored:
        raise ValueError(
            f"{type(module).__name__} holds tensors with storage ({', '.join(stored[:4])}"
            f"{', ...' if len(stored) > 4 else ''}) beside tensors on the meta device: materialising would overwrite "
            "them. Build the whole model in configure_model() (and load pretrained weights with HuggingFaceWeights "
            "or ckpt_path), or build all of it in __init__."
        )
    plan = InitPlan(seed)
    first: dict[int, tuple[str, str]] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for attr, tensor in owned_tensors(owner):
            source = first.setdefault(id(tensor), (owner_name, attr))
            plan.sources[f"{owner_name}.{attr}" if owner_name else attr] = source
            if source == (owner_name, attr) and owner_name not in plan.templates:
                template = plan.templates[owner_name] = copy.deepcopy(owner)  # meta: no storage is copied
                with torch.no_grad():
                    init(owner_name, template)  # on meta: checks the initialiser exists, computes nothing
    return plan


def meta_init_plan(module: nn.Module, init: InitFn, materialization: Optional[Materialization]) -> Optional[InitPlan]:
    """The initialisation plan of a ``meta`` model (None for one that has its storage already).

    Args:
        module: the whole model, before any split.
        init: the adapter's initialiser.
        materialization: device and seed (required for a ``meta`` model).

    Raises:
        ValueError: a ``meta`` model without ``materialization``.
    """
    if not any(p.is_meta for p in module.parameters()):
        return None
    if materialization is None:
        raise ValueError(
            f"{type(module).__name__} is on the meta device: pass materialization=Materialization(device, seed) so "
            "parallelize allocates and initialises this rank's share, or build the model with storage."
        )
    return plan_initialisation(module, materialization.seed, init)


def _full_values(plan: InitPlan, owner: str, init: InitFn) -> dict[str, Tensor]:
    """The owner's direct tensors at full size on the CPU, drawn from its own seeded stream.

    The template leaves the plan here: kept there after ``to_empty``, every owner's full-size tensors would
    pile up until the whole model (not one module) was held at once.
    """
    template = plan.templates.pop(owner).to_empty(device="cpu", recurse=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(layer_seed(plan.seed, owner))
        init(owner, template)
    values = dict(template.named_parameters(recurse=False))
    values.update(dict(template.named_buffers(recurse=False)))
    return values


def local_region(target: Tensor) -> Optional[tuple[slice, ...]]:
    """The slice of the global tensor this rank's DTensor shard holds; None when it is not one slice."""
    chunks = target.__create_chunk_list__()
    local = target.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        return None
    if any("Strided" in type(p).__name__ or not (p.is_shard() or p.is_replicate()) for p in target.placements):
        return None
    return tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))


def _fill(target: Tensor, full: Tensor) -> None:
    """Copy this rank's part of ``full`` into ``target`` (a DTensor's local shard, or a whole tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"an initialiser produced shape {tuple(full.shape)} for a tensor of shape {tuple(target.shape)}"
        )
    with torch.no_grad():
        if isinstance(target, DTensor):
            region = local_region(target)
            if region is not None:  # one slice: copied from a view, with no intermediate copy of the shard
                target.to_local().copy_(full[region])
                return
            # src_data_rank=None: every rank holds the full value already, so slicing needs no communication.
            local = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
        else:
            target.copy_(full)


def materialize(module: nn.Module, device: torch.device, plan: InitPlan, init: InitFn = reset_parameters) -> int:
    """Allocate this rank's share of a ``meta`` model on ``device`` and initialise it as every layout does.

    Call it after the model was split, tensor-sharded and wrapped on ``meta`` (FSDP2 and DTensor follow
    ``to_empty``); no collective is involved, so ranks holding different stages need not agree.

    Args:
        module: the parallelised model, still on ``meta``.
        device: this rank's device.
        plan: :func:`plan_initialisation` of the unsplit model.
        init: initialises one module's own tensors in place (the adapter's: ``reset_parameters()`` for the
            protocol, the model's ``_init_weights`` for a Hugging Face model).

    Returns:
        The bytes of parameters and buffers this rank now holds.

    Raises:
        ValueError: a tensor whose owner cannot be initialised (named, with the fix).
    """
    ties = tie_groups(module)
    module.to_empty(device=device)
    restore_ties(module, ties)  # to_empty gives each holder its own tensor; FSDP2 keeps its own ties
    cache: dict[str, dict[str, Tensor]] = {}
    held = 0
    named = [*module.named_parameters(), *module.named_buffers()]
    size = {owner: sum(t.numel() * t.element_size() for _, t in owned_tensors(template))
            for owner, template in plan.templates.items()}
    named.sort(key=lambda item: -size[plan.sources[item[0]][0]])  # largest first: little else is resident yet
    remaining = _uses_per_owner(plan, [name for name, _ in named])
    for name, tensor in named:
        owner, attr = plan.sources[name]
        if owner not in cache:
            cache[owner] = _full_values(plan, owner, init)
        _fill(tensor, cache[owner][attr])
        held += _local_bytes(tensor)
        remaining[owner] -= 1
        if remaining[owner] == 0:
            del cache[owner]  # one module's full size at a time
    return held


def _uses_per_owner(plan: InitPlan, names: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        owner = plan.sources[name][0]
        counts[owner] = counts.get(owner, 0) + 1
    return counts


def _local_bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


