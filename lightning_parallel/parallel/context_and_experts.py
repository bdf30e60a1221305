"""The axes that split tokens rather than layers: context (each sequence over ranks) and experts (each token to the
ranks holding its experts). Steps 2b and 2c of :func:`~lightning_parallel.parallel.compose.parallelize`, which
knows the order; here is what each does to this rank's share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_parallel.layout import CONTEXT_PARALLEL, ParallelLayout
from lightning_parallel.parallel.adapter import ModelAdapter
from lightning_parallel.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_parallel.parallel.context.plan import SequenceSplit


def batch_splits(layout: ParallelLayout, schedule: Optional[str] = None) -> list[str]:
    """How ``layout`` splits each global batch, as the settings that do it (for loss checks and messages); the
    pipeline entry names its ``schedule`` when given (``"pipeline_parallel_size=2 (schedule='1f1b')"``)."""
    sizes = [("data_parallel_size", layout.data_parallel), ("pipeline_parallel_size", layout.pipeline_parallel),
             ("context_parallel_size", layout.context_parallel)]
    splits = [f"{name}={size}" for name, size in sizes if size > 1]
    return [f"{s} (schedule={schedule!r})" if s.startswith("pipeline") and schedule else s for s in splits]


@dataclass(frozen=True)
class ExpertAxis:
    """Where experts live under expert parallelism (the strategy builds it once the mesh exists).

    Attributes:
        mesh: the 1-D expert mesh (``expert_parallel`` ranks holding one layer's experts between them).
        token_group: the data x context ranks, whose batches together are one process's.
        expert_data_group: the ranks holding the same experts (their gradients are summed over it).
        kernel: a grouped GEMM kernel (``lightning_parallel._compat.grouped_mm``), or None for the loop.
    """

    mesh: Any
    token_group: Any
    expert_data_group: Any
    kernel: Optional[Callable] = None


def apply_experts(module: nn.Module, layout: ParallelLayout, experts: Optional[ExpertAxis],
                   adapter: ModelAdapter) -> None:
    """Step 2's third part: the experts this rank holds sharded over the expert axis (after tensor and context,
    before checkpointing and FSDP2, which then leaves the expert slices to the expert-data reduction)."""
    if layout.expert_parallel == 1:
        return
    if experts is None:
        raise ValueError(f"{layout.describe()} shards experts: pass experts=ExpertAxis(...) (the strategy builds it).")
    adapter.apply_expert_parallel(module, experts.mesh, experts.token_group, experts.kernel)


def apply_context(module: nn.Module, layout: ParallelLayout, mesh: DeviceMesh, options: ParallelOptions,
                   adapter: ModelAdapter) -> Optional[SequenceSplit]:
    """Step 2's second half: the adapter makes the attention this rank holds see the whole sequence."""
    if not layout.context_parallel_enabled:
        return None
    from lightning_parallel.parallel.context.plan import ContextGroup

    axis = mesh[CONTEXT_PARALLEL]
    context = ContextGroup(axis.get_group(), layout.context_parallel, axis.get_local_rank(),
                           options.context_parallel_method)
    return adapter.apply_context_parallel(module, context)
