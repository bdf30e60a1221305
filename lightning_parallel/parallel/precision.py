"""Mixed precision under a data x pipeline x tensor layout: what is checked, and FSDP2's policy.

Lightning's precision names say how the model computes; this module says what that means
for each mesh axis, and refuses what would silently reduce gradients in bf16:

* ``bf16-mixed`` -- parameters, gradients and optimizer state stay fp32 (the master
  weights); ``torch.autocast`` runs matmuls in bf16. Under ``zero_stage`` 2/3 FSDP2's
  all-gathered parameters are bf16 (``param_dtype``) when there is no tensor parallelism;
  the data axis reduces gradients in fp32 (``reduce_dtype``) at every ZeRO stage.
* ``bf16-true`` -- Lightning converts the module to bf16: parameters, gradients and
  optimizer state are bf16 (the memory-saving choice the name asks for; ``bf16-mixed``
  keeps fp32 masters). Reductions across ranks still run in fp32: the data axis through
  FSDP2's ``reduce_dtype`` (``zero_stage=0``'s all-reduce included), while the tied-copy sums
  across pipeline ranks, ``replicated_grad_sum`` over the tensor ranks and the global
  clipping norm upcast before they communicate. Activations (and their gradients) cross
  ranks in their own dtype, bf16, as in Megatron-LM.

Note:
    FSDP2 applies ``reduce_dtype`` to its own reduce-scatter only: the ``Partial ->
    Replicate`` all-reduce over the tensor axis of a tensor-replicated parameter (a norm
    under sequence parallelism) runs in the gradient's dtype, i.e. ``param_dtype``
    (pytorch#190626). With tensor parallelism the suite therefore keeps FSDP2's unsharded
    parameters fp32 under ``bf16-mixed`` (autocast still computes in bf16), and refuses
    ``param_dtype="bfloat16"`` and ``bf16-true`` with sequence parallelism, where DTensor
    would reduce those gradients in bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from lightning_parallel.parallel.data import uses_data_axis
from lightning_parallel.parallel.option_checks import DTYPES

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.parallel.options import ParallelOptions

# Lightning precision names the data x pipeline x tensor strategies run.
SUPPORTED = ("32-true", "32", "bf16-mixed", "bf16-true")


def check_precision(precision: str, options: ParallelOptions, layout: ParallelLayout) -> None:
    """Refuse a Trainer precision / strategy option pair that cannot run as asked (before any process group).

    Args:
        precision: the Trainer's precision name (``precision_plugin.precision``).
        options: the strategy's options (``param_dtype``, ``reduce_dtype``, ``zero_stage``, ...).
        layout: the resolved layout.

    Raises:
        ValueError: a precision the strategy does not run, an FSDP2 dtype option without
            FSDP2, ``param_dtype="bfloat16"`` with tensor parallelism, or ``bf16-true``
            with sequence parallelism; each message names the fix.
    """
    precision = str(precision)
    if precision not in SUPPORTED:
        raise ValueError(
            f"precision={precision!r} is not supported by the data x pipeline x tensor strategies: use 'bf16-mixed' "
            "(bf16 compute, fp32 master weights, optimizer state and reductions), 'bf16-true' or '32-true'. fp16 needs "
            "loss scaling, which the pipelined and sharded gradients here do not implement."
        )
    if options.param_dtype is not None and not options.zero_stage:
        raise ValueError(
            f"param_dtype={options.param_dtype!r} sets the dtype FSDP2 all-gathers sharded parameters in; with "
            "zero_stage=0 nothing is sharded or gathered (the precision alone decides the compute dtype). Set "
            "zero_stage=2 or 3, or drop param_dtype."
        )
    if options.reduce_dtype != "float32" and not uses_data_axis(layout, options.zero_stage):
        raise ValueError(
            f"reduce_dtype={options.reduce_dtype!r} sets the dtype of the data-axis gradient reduction, but "
            f"{layout.describe()} with zero_stage=0 has no data axis to reduce over: drop reduce_dtype."
        )
    if options.param_dtype is not None and precision == "bf16-true":
        raise ValueError(
            f"param_dtype={options.param_dtype!r} has no effect under precision='bf16-true' (the module itself is "
            "bf16): drop param_dtype, or use precision='bf16-mixed' for fp32 master weights with bf16 compute."
        )
    if options.param_dtype == "bfloat16" and layout.tensor_parallel_enabled:
        raise ValueError(
            "param_dtype='bfloat16' with tensor_parallel_size > 1 would reduce tensor-replicated gradients "
            "(norms under sequence parallelism) in bf16: FSDP2 applies reduce_dtype only to its own reduce-scatter "
            "(pytorch#190626). Drop param_dtype (autocast still computes in bf16 under precision='bf16-mixed'), "
            "or tensor_parallel_size=1."
        )
    if precision == "bf16-true" and options.sequence_parallel:
        raise ValueError(
            "precision='bf16-true' with sequence_parallel=True: DTensor sums the norm gradients over the tensor ranks "
            "in the parameters' dtype, bf16. Use precision='bf16-mixed' (fp32 parameters, so those sums are fp32), "
            "or sequence_parallel=False."
        )


def fsdp_policy(precision: str, options: ParallelOptions, layout: ParallelLayout) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's ``MixedPrecisionPolicy`` for the data axis (None: FSDP2's default, everything in the parameters' dtype).

    ``param_dtype`` (the all-gathered, computing parameters): the option when given; else
    bf16 under ``bf16-mixed`` with ``zero_stage`` 2/3 and no tensor parallelism, the
    parameters' own dtype otherwise (see the module note; ``zero_stage=0``, replicated on
    FSDP2, keeps DDP's fp32 parameters under autocast). ``reduce_dtype``: the option
    (default fp32), for every data-axis reduction.

    Args:
        precision: the Trainer's precision name.
        options: the strategy's options (already checked by :func:`check_precision`).
        layout: the resolved layout.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if options.param_dtype is not None:
        param_dtype: Optional[torch.dtype] = DTYPES[options.param_dtype]
    elif str(precision) == "bf16-mixed" and options.zero_stage and not layout.tensor_parallel_enabled:
        param_dtype = torch.bfloat16
    else:
        param_dtype = None
    reduce_dtype = DTYPES[options.reduce_dtype]
    if param_dtype is None and reduce_dtype == torch.float32 and str(precision) != "bf16-true":
        return None  # fp32 parameters reduce in fp32 anyway
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def describe_precision(precision: str, options: ParallelOptions, layout: ParallelLayout,
                       data_engine: str = "FSDP2") -> str:
    """One line for the start-up table: compute, master weights and reduction dtypes.

    Args:
        precision: the Trainer's precision name.
        options: the strategy's options.
        layout: the resolved layout.
        data_engine: what holds the data axis (``"FSDP2"``, or ``"DDP"`` where :mod:`.replicated` applies).
    """
    precision = str(precision)
    masters = "bf16 (bf16-true)" if precision == "bf16-true" else "fp32"
    compute = {"bf16-mixed": "bf16 autocast", "bf16-true": "bf16"}.get(precision, "fp32")
    text = f"{precision}: compute {compute}, weights + optimizer state {masters}, tensor/pipeline reductions fp32"
    if uses_data_axis(layout, options.zero_stage):
        policy = fsdp_policy(precision, options, layout)
        gather = _name(policy.param_dtype) if policy is not None and policy.param_dtype is not None else "as weights"
        reduce = _name(policy.reduce_dtype) if policy is not None else "fp32"
        text += f"; data axis ({data_engine}): parameters {gather} in compute, gradients reduced in {reduce}"
    return text


def _name(dtype: Any) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def upcast_for_reduction(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as fp32 for a sum across ranks (a copy when it was lower precision, else itself).

    Args:
        tensor: a gradient (plain or DTensor) about to be reduced.
    """
    return tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor
