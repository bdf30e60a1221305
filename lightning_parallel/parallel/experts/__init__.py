"""Expert parallelism: an MoE block's experts sharded over an expert group, tokens moved by all-to-all.

* :mod:`.dispatch` -- the differentiable all-to-all of variable split sizes; rows sorted by expert sent to the
  ranks holding the experts and back (counts exchanged first); token-level :func:`dispatch`/:func:`combine`;
* :mod:`.capacity` -- capacity drops decided over a group as one process decides them on the whole batch;
* :mod:`.grouped` -- grouped matrix multiply: torch's kernel where it runs, a loop as reference and fallback;
* :mod:`.sharded` -- :class:`ExpertParallel`, the experts module a rank holds, and the expert gradients'
  reduction over the expert-data group.

Pure torch and ``torch.distributed``: process groups are always arguments.
"""

from __future__ import annotations

from lightning_parallel.parallel.experts.capacity import global_keep, kept_copies, kept_of_rank
from lightning_parallel.parallel.experts.dispatch import (
    ExpertRoute,
    TokenRoute,
    all_to_all,
    combine,
    combine_sorted,
    dispatch,
    dispatch_sorted,
    exchange_counts,
)
from lightning_parallel.parallel.experts.grouped import grouped_mm, kernel_fits, loop_grouped_mm
from lightning_parallel.parallel.experts.sharded import (
    ExpertParallel,
    expert_block,
    expert_parameters,
    expert_range,
    reduce_expert_gradients,
)

__all__ = [
    "ExpertParallel",
    "ExpertRoute",
    "TokenRoute",
    "all_to_all",
    "combine",
    "combine_sorted",
    "dispatch",
    "dispatch_sorted",
    "exchange_counts",
    "expert_block",
    "expert_parameters",
    "expert_range",
    "global_keep",
    "grouped_mm",
    "kept_copies",
    "kept_of_rank",
    "kernel_fits",
    "loop_grouped_mm",
    "reduce_expert_gradients",
]
