"""Tied parameters split across pipeline ranks: two copies kept identical, as Megatron's embedding group does.

With ``tie_word_embeddings=True`` the token embedding (first stage) and the LM head (last
stage) share one weight. After the split each rank holding one of them keeps its own
copy under its own name -- exactly the keys the unsplit model has, so checkpoints load
under any layout. The copies stay identical because

* they start equal: :func:`broadcast_tied` sends the first holder's value to the others
  before training;
* they receive the same gradient: :func:`sum_tied_gradients` adds every holder's
  contribution (the sum the single shared parameter gets in one process) on every holder
  before the optimizer step, in the same order everywhere so the sums are bit-identical;
* the same optimizer then applies the same update on each.

When all holders sit on one rank (a V schedule puts the first and the last stage on rank
0), the parameter simply stays one tied parameter there and nothing is exchanged.

Note:
    The copies of holders after the first are marked with :data:`TIED_COPY_ATTR` (as
    Megatron marks ``param.shared``), so a global gradient norm can count the pair once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.precision import upcast_for_reduction

TIED_COPY_ATTR = "pipeline_tied_copy"  # True on a parameter that is a further copy of a tied one


@dataclass(frozen=True)
class TiedCopies:
    """One tied parameter held by several pipeline ranks.

    Attributes:
        name: qualified name of this rank's copy (in the module and in its stage module).
        ranks: global ranks holding a copy, in stage order; ``ranks[0]`` holds the first.
        rank: this process's global rank.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int

    @property
    def is_first(self) -> bool:
        return self.rank == self.ranks[0]


def local_tied_copies(
    shared: Sequence[tuple[tuple[int, str], ...]],
    stage_of_layer: Sequence[int],
    rank_of_stage: Sequence[int],
    rank: int,
) -> list[TiedCopies]:
    """The tied parameters this rank must keep in step with other ranks.

    Args:
        shared: ``((layer index, qualified parameter name), ...)`` per shared parameter.
        stage_of_layer: the stage of every pipeline layer.
        rank_of_stage: the global rank running every stage (in this rank's pipeline).
        rank: this process's global rank.
    """
    result = []
    for holders in shared:
        ranks: list[int] = []
        local_name: Optional[str] = None
        for layer, name in sorted(holders, key=lambda h: stage_of_layer[h[0]]):
            holder = rank_of_stage[stage_of_layer[layer]]
            if holder not in ranks:
                ranks.append(holder)
            if holder == rank and local_name is None:
                local_name = name
        if local_name is not None and len(ranks) > 1:
            result.append(TiedCopies(local_name, tuple(ranks), rank))
    return result


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def mark_copies(module: nn.Module, tied: Sequence[TiedCopies]) -> None:
    """Mark the non-first copies (again after FSDP2 or TP swapped the parameter objects)."""
    for entry in tied:
        if not entry.is_first:
            setattr(module.get_parameter(entry.name), TIED_COPY_ATTR, True)


def broadcast_tied(module: nn.Module, tied: Sequence[TiedCopies], group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every copy the first holder's value (before training; run on every holder)."""
    with torch.no_grad():
        for entry in tied:
            data = _local(module.get_parameter(entry.name).data)
            if entry.is_first:
                for peer in entry.ranks[1:]:
                    dist.send(data.contiguous(), peer, group=group)
            else:
                received = torch.empty_like(data)
                dist.recv(received, entry.ranks[0], group=group)
                data.copy_(received)


def snapshot_gradients(module: nn.Module, tied: Sequence[TiedCopies]) -> list[Optional[Tensor]]:
    """The tied gradients before a step (an accumulation window may already hold some)."""
    params = [module.get_parameter(e.name) for e in tied]
    return [None if p.grad is None else _local(_as_parameter(p.grad, p)).clone() for p in params]


def _as_parameter(grad: Tensor, param: Tensor) -> Tensor:
    """``grad`` in ``param``'s placement (a DTensor gradient may come back in another one)."""
    placements = getattr(param, "placements", None)
    if placements is None or getattr(grad, "placements", placements) == placements:
        return grad
    return grad.redistribute(placements=placements)


def sum_tied_gradients(
    module: nn.Module,
    tied: Sequence[TiedCopies],
    before: Sequence[Optional[Tensor]],
    group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Add every holder's new gradient contribution to every copy, in stage order.

    Args:
        module: a module holding the copies under their names (a stage module will do).
        tied: this rank's tied copies.
        before: :func:`snapshot_gradients` taken before the step, so only the step's own
            contribution is exchanged (accumulated gradients are already identical).
        group: the process group whose ranks ``ranks`` are (global ranks as usual).
    """
    for entry, old in zip(tied, before):
        param = module.get_parameter(entry.name)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        # A gradient left in another placement (a vocabulary-sharded embedding's can come back replicated) is
        # exchanged as the parameter is laid out: every holder then sends and receives the same slice.
        param.grad = _as_parameter(param.grad, param)
        grad = _local(param.grad)
        # Exchanged and summed in fp32 whatever the gradient's dtype (bf16 under bf16-true).
        delta = (upcast_for_reduction(grad) - upcast_for_reduction(old) if old is not None
                 else upcast_for_reduction(grad).clone())
        parts = []
        for holder in entry.ranks:
            if holder == entry.rank:
                parts.append(delta)
                continue
            received = torch.empty_like(delta)
            ops = [dist.P2POp(dist.isend, delta, holder, group), dist.P2POp(dist.irecv, received, holder, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            parts.append(received)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        grad.copy_(total if old is None else upcast_for_reduction(old) + total)
        setattr(param, TIED_COPY_ATTR, not entry.is_first)


def _group_settings(param: Tensor, optimizers: Sequence[torch.optim.Optimizer]) -> str:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                settings = sorted((k, v) for k, v in group.items() if k != "params")
                return f"{type(optimizer).__name__} {settings}"
    return "not in any optimizer"


def check_tied_optimizer_groups(
    module: nn.Module, tied: Sequence[TiedCopies], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Refuse tied copies whose optimizer settings differ between their holders (a collective: every rank calls it).

    In one process the pair is one parameter in one param group. After the split each copy
    sits in whatever group the holder's ``configure_optimizers`` put its own name in -- for
    example weight decay exempting ``embed_tokens`` but not ``lm_head`` -- and identical
    gradients would then give different updates: the copies would drift apart silently.

    Args:
        module: the (split) module holding this rank's copies.
        tied: this rank's tied copies (the same shared parameters on every holder, in order).
        optimizers: this rank's optimizers, already built.

    Raises:
        ValueError: two holders of one tied parameter optimise it with different settings.
    """
    mine = {(entry.ranks, index): (entry.name, _group_settings(module.get_parameter(entry.name), optimizers))
            for index, entry in enumerate(tied)}
    gathered: list[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    seen: dict[tuple, tuple[str, str]] = {}
    for entries in gathered:
        for key, (name, settings) in (entries or {}).items():
            first = seen.setdefault(key, (name, settings))
            if first[1] != settings:
                raise ValueError(
                    f"The tied parameters {first[0]!r} and {name!r} (one parameter in one process, a copy on each "
                    f"pipeline rank holding them) are optimised with different settings: {first[1]} vs {settings}. "
                    "They would drift apart. Put both names in the same param group in configure_optimizers "
                    f"(for example exempt {name!r} from weight decay exactly when {first[0]!r} is)."
                )
