"""The start-up table's rows for a layout: which global ranks form each group."""

from __future__ import annotations

from lightning_parallel.layout import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    DATA_REPLICATE,
    DATA_SHARD,
    EXPERT_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    ParallelLayout,
)


def rank_map_rows(layout: ParallelLayout, limit: int = 16) -> dict[str, str]:
    """The rank map: which global ranks form each tensor, pipeline and data group.

    Args:
        layout: the resolved layout.
        limit: groups shown per axis before eliding.
    """
    rows = {}
    axes = [("tensor groups", TENSOR_PARALLEL), ("pipeline groups", PIPELINE_PARALLEL),
            ("context groups", CONTEXT_PARALLEL), ("data groups", DATA_PARALLEL), ("expert groups", EXPERT_PARALLEL)]
    if layout.hsdp_enabled:  # the data groups split: shard within a group, all-reduce across groups
        axes += [("data shard groups", DATA_SHARD), ("data replica groups", DATA_REPLICATE)]
    for label, axis in axes:
        groups = sorted({tuple(layout.group_ranks(axis, rank)) for rank in range(layout.world_size)})
        if len(groups[0]) == 1:
            continue
        shown = " ".join(str(list(g)) for g in groups[:limit]) + (" ..." if len(groups) > limit else "")
        rows[label] = shown
    shown_ranks = layout.rank_map()[: limit * 2]
    if layout.context_parallel_enabled:  # the context coordinate only where there is one
        rows["rank -> (data, pipeline, tensor, context)"] = " ".join(
            f"{r}:{(*c, layout.context_rank(r))}" for r, c in shown_ranks)
    else:
        rows["rank -> (data, pipeline, tensor)"] = " ".join(f"{r}:{tuple(c)}" for r, c in shown_ranks)
    return rows
