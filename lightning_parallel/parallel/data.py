"""The data axis under FSDP2: shard each pipeline layer, then the roots, over the data-parallel mesh.

Replicated data parallelism (``zero_stage=0``) averages gradients once per optimizer step
with :func:`lightning_parallel.parallel.gradients.all_reduce_gradients`; ZeRO-2/3 use
torch's ``fully_shard`` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def has_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds at least one parameter (a layer of another stage holds none)."""
    return any(True for _ in module.parameters())


def shard_data_axis(
    layers: Sequence[nn.Module], roots: Sequence[nn.Module], dp_mesh: DeviceMesh, zero_stage: int
) -> None:
    """Apply FSDP2 ``fully_shard`` per layer, then to each root, over the data-parallel mesh.

    Args:
        layers: the model's pipeline layers (each becomes its own FSDP unit, so parameters
            are gathered one layer at a time); layers of other stages hold no parameters and
            are skipped.
        roots: the modules that take the remaining parameters: the whole model, or under
            pipelining each local stage module (so ``PipelineStage`` sees an FSDP module and
            controls gradient synchronisation per micro-batch).
        dp_mesh: the one-dimensional data-parallel mesh.
        zero_stage: 2 (gradients and optimizer state sharded, parameters kept gathered after
            forward) or 3 (parameters resharded after forward).
    """
    from torch.distributed.fsdp import fully_shard

    reshard = zero_stage == 3
    for layer in layers:
        if has_parameters(layer):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard)
