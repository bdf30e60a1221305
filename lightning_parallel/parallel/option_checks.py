"""The checks of :class:`~lightning_parallel.parallel.options.ParallelOptions` that hold for any world and module.

One function per group of options, each given the values it checks and raising ``ValueError`` that names the fix;
:class:`~lightning_parallel.parallel.options.ParallelOptions` calls them, in order, when it is constructed. Checks
that need the module or the world size live in :mod:`lightning_parallel.parallel.compose` and
:mod:`lightning_parallel.layout`.

Note:
    This module imports nothing of :mod:`.options` or :mod:`.precision`: both build on it (the options check their
    dtype names here, the precision policy maps the same names to torch dtypes), so neither imports the other's
    module back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from lightning_parallel.layout import Size, check_size
from lightning_parallel.parallel.pipeline.partition import METHODS

ZERO_STAGES = (0, 2, 3)
OFFLOAD_MODES = ("none", "params")
CONTEXT_METHODS = ("ring", "ulysses")  # see lightning_parallel.parallel.context
# The dtype names param_dtype and reduce_dtype take, and what they mean to torch (parallel/precision.py).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_dtype_option(name: str, value: Optional[str], allow_none: bool) -> None:
    """Refuse a ``param_dtype``/``reduce_dtype`` option that is not a dtype name.

    Args:
        name: the option's name, for the message.
        value: its value.
        allow_none: whether None (chosen from the precision) is allowed.

    Raises:
        ValueError: ``value`` is not ``"float32"``/``"bfloat16"`` (or ``None`` where allowed).
    """
    if value is None and allow_none:
        return
    if value not in DTYPES:
        choices = " or ".join(repr(d) for d in DTYPES) + (" (None: chosen from the precision)" if allow_none else "")
        raise ValueError(f"{name}={value!r} is not a dtype the suite reduces or computes in: use {choices}.")


def check_zero_stage(zero_stage: Any) -> None:
    """Refuse a ZeRO stage the data axis does not run (ZeRO-1 is DeepSpeed's)."""
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(
            f"zero_stage={zero_stage!r} is not supported: use 0 (replicate), 2 (FSDP2 shards gradients and "
            "optimizer state) or 3 (parameters too). For ZeRO-1 use strategy=deepspeed_zero1."
        )


def check_tensor_flags(tensor_parallel_size: Size, **flags: bool) -> None:
    """Refuse ``loss_parallel``/``sequence_parallel`` (given by name in ``flags``) without a tensor group."""
    for flag, on in flags.items():
        if on and tensor_parallel_size == 1:
            raise ValueError(
                f"{flag}=True needs tensor_parallel_size > 1 (it shards over the tensor group), but "
                f"tensor_parallel_size=1: set tensor_parallel_size >= 2, or {flag}=False."
            )


def check_partition(partition: Any) -> Union[str, tuple[int, ...]]:
    """A pipeline partition as a method name or a tuple of cut points (a list from Hydra becomes a tuple)."""
    if isinstance(partition, str) and partition not in METHODS:
        raise ValueError(f"Unknown partition {partition!r}: use one of {METHODS} or cut points such as [3, 5].")
    if isinstance(partition, str):
        return partition
    if isinstance(partition, Sequence) and all(isinstance(p, int) and not isinstance(p, bool) for p in partition):
        return tuple(partition)
    raise ValueError(f"partition={partition!r} is neither a method name {METHODS} nor a list of integer cut points.")


def comm_hook_reduce_dtype(comm_hook: str, reduce_dtype: str) -> str:
    """The reduce dtype ``comm_hook`` asks for: ``"bf16"`` is FSDP2's form of DDP's ``bf16_compress_hook``.

    Raises:
        ValueError: a hook with no FSDP2 form (``fp16``, ``powersgd``: the message names DDP's), or an unknown one.
    """
    refused = {
        "fp16": "fp16 gradients overflow without loss scaling, which the suite does not run: use "
                "comm_hook='bf16' (same bytes, fp32's exponent range), or for a data-parallel-only layout "
                "strategy=ddp strategy.comm_hook=fp16 (DDP's fp16_compress_hook)",
        "powersgd": "PowerSGD needs DDP's reducer (its hook replaces DDP's bucket all-reduce); the data axis runs "
                    "on FSDP2, which composes with tensor and pipeline parallelism but has no communication hooks "
                    "(only reduce_dtype). Use comm_hook='bf16' to halve the bytes, or for a data-parallel-only "
                    "layout strategy=ddp strategy.comm_hook=powersgd (DDP with torch's PowerSGD hook)",
    }
    if comm_hook in refused:
        raise ValueError(f"comm_hook={comm_hook!r} cannot run here: {refused[comm_hook]}.")
    if comm_hook not in ("none", "bf16"):
        raise ValueError(f"Unknown comm_hook={comm_hook!r}: use 'none' or 'bf16' (gradients reduced in bf16).")
    return "bfloat16" if comm_hook == "bf16" else reduce_dtype


def check_data_split(zero_stage: int, data_replicate_size: Optional[int], data_shard_size: Optional[int]) -> None:
    """Refuse an HSDP split of the data axis that is not a size, or one where nothing is sharded."""
    given = {"data_replicate_size": data_replicate_size, "data_shard_size": data_shard_size}
    split = {name: value for name, value in given.items() if value is not None}
    for name, value in split.items():
        if value == "auto":
            raise ValueError(f"{name}='auto' is not supported: give a size, or leave it None (derived).")
        check_size(name, value)
    if split and zero_stage == 0:
        listed = ", ".join(f"{n}={v}" for n, v in split.items())
        raise ValueError(
            f"{listed} splits the data axis for HSDP, which shards within a group: zero_stage=0 replicates the "
            "model on every data rank and all-reduces over the whole axis. Fix: zero_stage=2 or 3, or drop it."
        )


def check_bucket(zero_stage: int, bucket_size_mb: Optional[float], fsdp_prefetch: Optional[int]) -> None:
    """Refuse a bucket size that is not a size, one under ZeRO 3, or one beside ``fsdp_prefetch``."""
    size = bucket_size_mb
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
        raise ValueError(f"bucket_size_mb={size!r} must be a number >= 0 (megabytes; 0: one all-reduce per layer).")
    if zero_stage == 3:
        raise ValueError(
            f"bucket_size_mb={size} groups layers into one FSDP2 unit, but zero_stage=3 gathers each unit again "
            "in backward: a bigger unit holds more gathered parameters. Drop bucket_size_mb, or use zero_stage=2 "
            "(parameters stay gathered from forward to backward there anyway) or 0."
        )
    if zero_stage and size and fsdp_prefetch:  # (validated in check_prefetch)
        raise ValueError(f"fsdp_prefetch counts layers, bucket_size_mb={size} groups them into units: drop one.")


def check_prefetch(fsdp_prefetch: Optional[int], zero_stage: int) -> None:
    """Refuse a prefetch depth that is not a count of layers, or one where nothing is gathered (ZeRO 0)."""
    depth = fsdp_prefetch
    if depth is None:
        return
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"fsdp_prefetch={depth!r} must be an integer >= 1 (layers prefetched ahead), or null for "
                         "FSDP2's default.")
    if not zero_stage:
        raise ValueError(
            f"fsdp_prefetch={depth} issues the all-gathers of sharded parameters early, but zero_stage=0 keeps "
            "the whole model on every data rank (nothing is gathered). "
            "Use zero_stage=2 or 3, or drop fsdp_prefetch."
        )


def check_offload(offload: str, zero_stage: int) -> None:
    """Refuse an offload FSDP2 has no form of (``optimizer``), an unknown one, or one where nothing is sharded."""
    if offload == "optimizer":
        raise ValueError(
            "offload='optimizer' has no FSDP2 form: FSDP2's one offload policy, CPUOffloadPolicy, keeps the "
            "sharded parameters, their gradients and the optimizer state in host memory together (the optimizer "
            "steps on the CPU, where the parameters are); there is no optimizer-state-only policy. Use "
            "offload='params' (it offloads the optimizer state too), or for a data-parallel-only layout "
            "strategy=deepspeed strategy.offload_optimizer=true (DeepSpeed's ZeRO-Offload of the optimizer alone)."
        )
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"Unknown offload={offload!r}: use one of {OFFLOAD_MODES} ('params': parameters, "
                         "gradients and optimizer state in host memory).")
    if offload != "none" and not zero_stage:
        raise ValueError(
            f"offload={offload!r} moves FSDP2's sharded parameters to host memory, but zero_stage=0 keeps "
            "the whole model on every data rank (nothing is sharded). Use zero_stage=3 (or 2), or offload='none'."
        )


def check_context(context_parallel_size: Size, expert_parallel_size: Any, context_parallel_method: str) -> None:
    """Refuse a context or expert size that is not a size (``"auto"`` is one for context only), or an unknown
    context method."""
    check_size("context_parallel_size", context_parallel_size)  # "auto": what the other sizes leave
    if expert_parallel_size == "auto":
        raise ValueError("expert_parallel_size='auto' is not supported: give the ranks that share each layer's "
                         "experts (a divisor of data x context size; 1: off).")
    check_size("expert_parallel_size", expert_parallel_size)
    if context_parallel_method not in CONTEXT_METHODS:
        raise ValueError(f"Unknown context_parallel_method={context_parallel_method!r}: use 'ring' (any head "
                         "count) or 'ulysses' (all-to-all; heads divisible by tensor x context size).")
