"""DeepSpeed's private merges and undocumented engine parts the suite relies on (the door:
:mod:`lightning_parallel._compat`).

Each touch point says why it is private; ``tests/unit/test_compat.py`` has a canary for each.
"""

from __future__ import annotations

from typing import Any


def zero_merge_trainable_params(
    stage: int, merged: dict[str, Any], world_size: int, flat_per_rank: Any, model_states: Any, paddings: Any
) -> None:
    """Rebuild full tensors from ZeRO flat partitions into ``merged`` (``zero_to_fp32``'s private merges).

    Why private: DeepSpeed exposes only whole-checkpoint conversions; the per-state merge is
    what lets optimizer moments (laid out like the fp32 partitions) be re-split per parameter.
    """
    from deepspeed.utils import zero_to_fp32

    if stage <= 2:
        zero_to_fp32._zero2_merge_trainable_params(merged, world_size, flat_per_rank, model_states, paddings)
    else:
        zero_to_fp32._zero3_merge_trainable_params(merged, world_size, flat_per_rank, model_states)


def zero3_param_coordinator(engine: Any) -> Any:
    """The ZeRO-3 parameter coordinator of a DeepSpeed engine, or ``None`` (other stages, no engine yet).

    Undocumented: the coordinator's ``reset_step`` ends a traced step; the ZeRO-3 strategy
    runs it once per redirected Lightning step.
    """
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    if not callable(partitioned) or not partitioned():
        return None
    optimizer = getattr(engine, "optimizer", None)
    # Training engine: the ZeRO-3 optimizer holds the offload object; an engine without
    # optimizer (validate/test/predict) has the offload object as its optimizer.
    offload = getattr(optimizer, "parameter_offload", optimizer)
    get_coordinator = getattr(offload, "get_param_coordinator", None)
    return get_coordinator() if callable(get_coordinator) else None


def skip_inference_shm_comm() -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, before its comm backend starts.

    Why private: DeepSpeed's ``TorchBackend`` compiles that op (C++ through ninja: 24 s on 2 cores, and a compiler
    required) the first time it starts on CPU on a machine, and again whenever another DeepSpeed install built the
    cached one; the op serves ``inference_all_reduce`` only (module_inject's inference tensor parallelism), which ZeRO
    training never calls. ``deepspeed.ops.__compatible_ops__`` is the switch ``build_shm_op`` consults, and the
    ``deepspeed.ops`` module keeps edits to it (its own comment).
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
