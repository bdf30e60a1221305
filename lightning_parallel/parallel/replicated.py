"""The replicated data axis on plain tensors: torch's ``DistributedDataParallel`` where nothing else shards.

``zero_stage=0`` is FSDP2 with shard groups of one rank (:mod:`.data`) wherever the data axis meets
tensor or pipeline parallelism, experts, a reduction dtype other than the parameters' or an offload:
FSDP2 is the one engine that composes with all of them. Where it meets none of them -- pure data
parallelism, the commonest layout there is, alone or with context parallelism -- FSDP2 still makes
every parameter a DTensor, and the optimizer step then pays DTensor dispatch per parameter and op:
measured 1.38x torch's DDP loop (``benchmarks/results/2026-12-04/overhead_quick``). There the axis is
torch's ``DistributedDataParallel`` over the data (x context) group instead: plain tensors, gradients
bucketed (``bucket_size_mb``) and all-reduced during backward by DDP's C++ reducer, an average over
the same ranks FSDP2 averaged over, so the losses are those of FSDP2's ZeRO 0 and of one device.

The wrapper is what Lightning's own ``DDPStrategy`` builds: ``DistributedDataParallel`` around the
``LightningModule``, whose steps Lightning redirects through the wrapper's ``forward`` so DDP's
pre/post-forward hooks run whatever ``training_step`` calls. Parameter names, checkpoints and the
optimizer see the unwrapped module. Two settings differ from DDP's defaults, each for a reason:
``forward_sync_buffers=False`` (FSDP2 never broadcast buffers: a buffer-carrying model, e.g. rotary
frequencies, would otherwise pay one broadcast per forward) and ``gradient_as_bucket_view=True``
(the reduced bucket is the gradient: no copy back per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.precision import fsdp_policy

# The start-up table's data row where this module holds the axis.
PLAIN_REPLICATION = "replicated, gradient all-reduce in buckets during backward (torch DDP, plain tensors)"

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel


def replicates_plain(layout: ParallelLayout, options: ParallelOptions, precision: str) -> bool:
    """Whether the data axis is torch's DDP on plain tensors (else FSDP2, :mod:`.data`).

    Args:
        layout: the resolved layout.
        options: the run's options.
        precision: the Trainer's precision name (a reduction dtype other than the parameters' needs FSDP2's policy).
    """
    return (options.zero_stage == 0 and layout.data_context > 1 and not layout.tensor_parallel_enabled
            and not layout.pipeline_parallel_enabled and layout.expert_parallel == 1 and options.offload == "none"
            and fsdp_policy(precision, options, layout) is None)


def replicate_module(module: nn.Module, dp_mesh: DeviceMesh, bucket_bytes: int,
                     find_unused_parameters: bool = False) -> DistributedDataParallel:
    """Wrap ``module`` (materialised, on its device) in DDP over ``dp_mesh``'s replicated dimension.

    DDP broadcasts rank 0's parameters and buffers once here, so replicas start equal even from an unseeded
    build.

    Args:
        module: the whole model (the ``LightningModule``), this rank's copy.
        dp_mesh: the data mesh ``data_axis_mesh`` gives: 1-D, or ``(data_replicate, data_shard)`` with shards of 1.
        bucket_bytes: DDP's bucket size (``ParallelOptions.bucket_bytes``; 0: one bucket per parameter).
        find_unused_parameters: DDP's option (``ParallelOptions.find_unused_parameters``).
    """
    from torch.nn.parallel import DistributedDataParallel

    group = dp_mesh.get_group(0)  # the replicate dimension: under zero_stage=0 the shard dimension has size 1
    device = _device(module)
    return DistributedDataParallel(
        module, device_ids=[device.index] if device is not None and device.type == "cuda" else None,
        process_group=group, bucket_cap_mb=max(bucket_bytes, 1) / 2**20, forward_sync_buffers=False,
        gradient_as_bucket_view=True, find_unused_parameters=find_unused_parameters,
    )


def _device(module: nn.Module) -> Optional[object]:
    parameter = next(module.parameters(), None)
    return None if parameter is None else parameter.device
