"""The hybrid strategy's rows of the start-up table: what each axis of the layout does."""

from __future__ import annotations

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.layout.rows import rank_map_rows
from lightning_parallel.parallel.activation_checkpoint import describe_choice
from lightning_parallel.parallel.compile import compile_backend
from lightning_parallel.parallel.options import OFFLOAD_DESCRIPTIONS, ZERO_DESCRIPTIONS, ParallelOptions
from lightning_parallel.parallel.precision import describe_precision
from lightning_parallel.parallel.replicated import PLAIN_REPLICATION, replicates_plain


def layout_rows(options: ParallelOptions, layout: ParallelLayout, precision: str) -> dict[str, str]:
    """``{row: text}`` for the pipeline, context, tensor and data axes, precision, checkpointing and the rank map.

    Args:
        options: the strategy's options.
        layout: the resolved layout.
        precision: the Trainer's precision name.
    """
    o, rows = options, {}
    if layout.pipeline_parallel_enabled:
        rows["pipeline"] = (
            f"schedule {o.schedule}, {o.microbatches} micro-batches, {o.num_stages(layout.pipeline_parallel)} "
            f"stages ({o.stages_per_rank}/rank), partition {o.partition}"
        )
    if layout.context_parallel_enabled:
        rows["context"] = (f"{layout.context_parallel} ranks split every sequence ({o.context_parallel_method}; "
                           "head-tail chunks for causal balance)")
    if layout.expert_parallel > 1:
        holding = layout.expert_data
        rows["experts"] = (f"{layout.expert_parallel} ranks share each MoE layer's experts (all-to-all token "
                           f"dispatch); " + (f"sharded again over the {holding} holding the same experts (FSDP2, "
                                             "dim 1)" if o.expert_data_shard and holding > 1 else
                                             f"gradients summed over {holding} holding the same experts"))
    if layout.tensor_parallel_enabled:
        rows["tensor"] = f"sequence_parallel={o.sequence_parallel}, loss_parallel={o.loss_parallel}"
    plain = replicates_plain(layout, o, precision)
    rows["data"] = (PLAIN_REPLICATION if plain else ZERO_DESCRIPTIONS[o.zero_stage]) + (
        f"; layers grouped into units of up to {o.bucket_size_mb:g} MB" if o.zero_stage and o.bucket_bytes else ""
    ) + (
        f"; HSDP {layout.data_replicate} replica groups x {layout.data_shard} shards" if layout.hsdp_enabled else ""
    ) + (f"; offload {o.offload}: {OFFLOAD_DESCRIPTIONS[o.offload]}" if o.offload != "none" else "")
    rows["precision"] = describe_precision(precision, o, layout, "DDP" if plain else "FSDP2")
    rows["activation checkpointing"] = describe_choice(o.activation_checkpointing)
    if o.compile is not False:
        rows["compile"] = f"torch.compile per layer, backend {compile_backend(o.compile)}"
    rows.update(rank_map_rows(layout))
    return rows
