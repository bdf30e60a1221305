"""Everything about a module and a layout that can be checked before a process group exists.

:func:`check_module` is what a strategy (and ``lp-train``'s preflight, on ``meta``) runs before any rank starts;
:func:`~lightning_parallel.parallel.compose.parallelize` runs the same checks on the whole model (:func:`check_whole`)
before it splits anything, so a run refused here is refused there with the same message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.parallel.adapter import ModelAdapter
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.cut import check_pipeline
from lightning_parallel.parallel.pipeline.plan import PipelinePlan
from lightning_parallel.parallel.pipeline.stages import RemovedLayer
from lightning_parallel.parallel.tensor.plan import concrete_plan, validate_tensor_parallel
from lightning_parallel.parallel.context_and_experts import batch_splits

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def check_module(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: Optional[ModelAdapter] = None
) -> dict[str, ParallelStyle]:
    """Everything about ``module`` that can be checked before a process group exists.

    Args:
        module: the whole model (any device, ``meta`` included; the layer-chain check runs
            only on materialised weights).
        layout: the resolved layout.
        options: the run's options.
        adapter: the model's adapter (a public entry point: resolved here when not given,
            ``ModelAdapter.resolve(module)``; the strategies pass the one they resolved once).

    Returns:
        The resolved tensor-parallel plan (empty without tensor parallelism).

    Raises:
        ValueError: a module that cannot be pipelined (a Hugging Face model without a
            pipeline plan, an encoder-decoder, a layer chain that does not compose to
            ``forward``), too few layers for the stages, a schedule the layout cannot run,
            or a plan the tensor size does not divide.
    """
    adapter = adapter or ModelAdapter.resolve(module)
    check_activation_checkpointing(module, options.activation_checkpointing, adapter=adapter)
    return check_whole(module, layout, options, adapter)[1]  # the same checks parallelize runs on the whole model


def check_activation_checkpointing(
    module: nn.Module, choice: activation_checkpoint.Choice, *, adapter: ModelAdapter
) -> None:
    """Refuse an ``activation_checkpointing`` choice (validated by ``check_choice``) that would checkpoint nothing:
    a glob naming no submodule, or ``full``/``selective`` on a module without layers (``adapter.layers()``)."""
    if isinstance(choice, tuple):
        activation_checkpoint.matching_modules(module, choice)
    elif choice != "none" and not adapter.layers():
        raise ValueError(
            f"activation_checkpointing={choice!r} checkpoints the model's layers, but {type(module).__name__} has "
            "neither pipeline_layers() nor a Hugging Face decoder's layers: define pipeline_layers(), or name the "
            "submodules to checkpoint with a list of globs (activation_checkpointing=['blocks.*'])."
        )


def check_tensor(
    module: nn.Module, layout: ParallelLayout, options: ParallelOptions, *, adapter: ModelAdapter
) -> dict[str, ParallelStyle]:
    """The tensor half of :func:`check_module`; returns the resolved plan (empty without tensor parallelism)."""
    if not layout.tensor_parallel_enabled:
        return {}
    plan = concrete_plan(
        module, options.plan, sequence_parallel=options.sequence_parallel, loss_parallel=options.loss_parallel,
        adapter=adapter,
    )
    validate_tensor_parallel(module, plan, layout.tensor_parallel, adapter=adapter)
    return plan


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` was already split or sharded (placeholders, DTensor parameters or FSDP2 units)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, (RemovedLayer, FSDPModule)) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def check_whole(module: nn.Module, layout: ParallelLayout, options: ParallelOptions,
                 adapter: ModelAdapter) -> tuple[Optional[PipelinePlan], dict]:
    """The checks on the whole model, before the split: ``(pipeline plan or None, tensor plan)``."""
    pipe = check_pipeline(module, layout, options, adapter=adapter) if layout.pipeline_parallel_enabled else None
    plan = check_tensor(module, layout, options, adapter=adapter)
    if layout.context_parallel_enabled:  # on the whole model: a pipeline rank's share may hold no attention
        adapter.check_context_parallel(options.context_parallel_method, layout.context_parallel, layout.tensor_parallel)
    adapter.check_batch_split(batch_splits(layout, options.schedule))
    if layout.expert_parallel > 1:
        adapter.check_expert_parallel(layout.expert_parallel)
    check_options_on_layout(options, layout)
    return pipe, plan


# Schedules that split each backward into an input pass and a weight pass (torch's zero-bubble family).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")


def check_options_on_layout(options: ParallelOptions, layout: ParallelLayout) -> None:
    """Refuse option combinations that only the layout shows cannot work (before any process group).

    Args:
        options: the run's options.
        layout: the run's layout.

    Raises:
        ValueError: ``expert_data_shard`` where each expert lives on one rank only (nothing would be sharded), or a
            split-backward pipeline schedule under ``zero_stage=3``; each naming the fix.
    """
    if layout.pipeline_parallel_enabled and options.schedule in SPLIT_BACKWARD_SCHEDULES and options.zero_stage == 3:
        # torch 2.13's weight pass runs after FSDP2 resharded the stage: measured under data 2 x pipeline 2 on the GPT
        # recipe, zbv 1.34, interleaved_zero_bubble 1.21, dualpipev 0.034 off one process's losses (the head's
        # parameters got no gradient); ZeRO 2 with the same schedules: 4.8e-7.
        raise ValueError(f"schedule={options.schedule!r} splits each backward into an input and a weight pass, and "
                         "with zero_stage=3 FSDP2 reshards a stage's parameters before its weight pass (the run would "
                         "train other weights): use zero_stage=2 with this schedule, or a schedule without split "
                         "backward (1f1b, interleaved_1f1b) with zero_stage=3.")
    if options.expert_data_shard and layout.data_context == layout.expert_parallel:  # never less than asked
        raise ValueError(f"expert_data_shard=True shards experts over the ranks holding the same ones, but under "
                         f"{layout.describe()} each expert is on one rank only (expert size = data x context size "
                         f"{layout.data_context}): use a smaller expert_parallel_size, or drop expert_data_shard.")


def refuse_parallelized(module: nn.Module) -> None:
    if is_parallelized(module):
        raise ValueError(
            f"{type(module).__name__} was already split or sharded by an earlier run and cannot be parallelised again: "
            "build a fresh module and load the checkpoint into it (ckpt_path=...)."
        )


def check_checkpoint_format(options: ParallelOptions, layout: ParallelLayout) -> None:
    """Refuse a single-file checkpoint under pipelining (rank 0 holds only the first stage).

    Args:
        options: the run's options (``save_distributed_checkpoint``).
        layout: the run's layout.

    Raises:
        ValueError: ``save_distributed_checkpoint=False`` with a pipeline, naming the fix.
    """
    if layout.pipeline_parallel_enabled and not options.save_distributed_checkpoint:
        raise ValueError("save_distributed_checkpoint=False gathers one file on rank 0, which holds only the first "
                         "pipeline stage: keep save_distributed_checkpoint=True under pipeline parallelism "
                         "(the folder loads under any layout).")
