"""Where a tensor-parallel parameter's gradient lands: in its parameter's placement, settled once in backward."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


def settle_gradients(module: nn.Module) -> None:
    """Give each DTensor parameter's gradient the parameter's placement, once, in backward.

    Note:
        torch leaves some gradients in another placement than their parameter: a
        ``SequenceParallel`` norm's replicated weight gets a ``Partial`` (unreduced)
        gradient, a vocabulary-sharded embedding a replicated one. Every later use (each
        optimizer op, the clipping norm) would then redistribute it again -- 30
        all-reduces in one AdamW step of a 2-block GPT -- and a ``Partial`` gradient read
        through ``to_local()`` is wrong. One redistribution in the gradient hook fixes both.
    """
    from torch.distributed.tensor import DTensor

    for param in module.parameters(recurse=False):
        # Not on meta: ``to_empty`` keeps the parameter object but not the gradient node its hooks sit on, and a
        # later hook joins the stale ones (none fire); ``resettle_gradients`` registers them once materialised.
        if isinstance(param, DTensor) and param.requires_grad and not param.is_meta:
            placements = param.placements
            param.register_hook(
                lambda grad, placements=placements: grad.redistribute(placements=placements)
                if isinstance(grad, DTensor) and grad.placements != placements
                else grad
            )


def resettle_gradients(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """Register :func:`settle_gradients`' hooks again on the planned submodules' current parameters.

    ``to_empty`` (materialising a model parallelised on ``meta``) gives every module new parameter objects,
    and with them goes the hook each DTensor parameter got in ``apply_tensor_parallel``. Parameters FSDP2
    manages are left alone: FSDP2 replaced the originals (and their hooks) in either build, and keeps its
    own across ``to_empty``.

    Args:
        module: the materialised model (or stage).
        plan: the plan that was applied (names of submodules this rank may hold).
    """
    from torch.distributed.fsdp import FSDPModule

    wrapped = [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    for name in plan:
        if not holds(module, name) or any(w == "" or name == w or name.startswith(w + ".") for w in wrapped):
            continue
        settle_gradients(module.get_submodule(name))


def holds(module: nn.Module, name: str) -> bool:
    """Whether ``module`` (a model or a pipeline stage of it) holds the submodule ``name``."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
