"""Rescale batch, accumulation, learning rate and warm-up when the data-parallel size changes.

Pure arithmetic, no torch.distributed. The global batch is
``micro_batch x accumulate_grad_batches x data_parallel``: pipeline and tensor sizes do
not multiply it (all ranks of a pipeline or tensor group work on the same samples).

Rules (given a reference run: its global batch, lr and warm-up):

* ``none``: use the configured values as they are.
* ``linear``: lr proportional to the global batch (Goyal et al. 2017), warm-up kept at the
  same number of *samples* (so fewer steps for a larger batch).
* ``sqrt``: lr proportional to the square root of the global batch (the usual rule for
  Adam-family optimizers); warm-up as for ``linear``.
* ``fixed_global_batch``: keep the reference global batch by choosing the gradient
  accumulation from the data-parallel size; lr and warm-up unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

RULES = ("none", "linear", "sqrt", "fixed_global_batch")


@dataclass(frozen=True)
class Reference:
    """The run the hyperparameters were tuned for.

    Args:
        global_batch_size: samples per optimizer step of the reference run.
        lr: its peak learning rate.
        warmup_steps: its warm-up length in optimizer steps.
        devices: its data-parallel size (informational; the batch rule does not need it).
    """

    global_batch_size: Optional[int] = None
    lr: Optional[float] = None
    warmup_steps: int = 0
    devices: Optional[int] = None


@dataclass(frozen=True)
class EffectiveHparams:
    """What a run actually uses after rescaling."""

    rule: str
    data_parallel: int
    micro_batch_size: int
    accumulate_grad_batches: int
    global_batch_size: int
    lr: float
    warmup_steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def rescale(
    rule: str,
    reference: Reference,
    data_parallel: int,
    micro_batch_size: int,
    accumulate_grad_batches: int = 1,
    lr: Optional[float] = None,
    warmup_steps: int = 0,
) -> EffectiveHparams:
    """Apply ``rule`` for a run with ``data_parallel`` replicas.

    Args:
        rule: one of ``none``, ``linear``, ``sqrt``, ``fixed_global_batch``.
        reference: the tuned reference point (ignored by ``none``).
        data_parallel: data-parallel size of this run (not pipeline or tensor size).
        micro_batch_size: samples per data-parallel rank per forward/backward.
        accumulate_grad_batches: configured accumulation (``fixed_global_batch`` replaces it).
        lr: configured learning rate (used by ``none``, and as the reference lr when the
            reference gives none).
        warmup_steps: configured warm-up (likewise).

    Raises:
        ValueError: unknown rule, missing reference values, or a reference global batch that
            cannot be reached exactly; the message names the fix.
    """
    if rule not in RULES:
        raise ValueError(f"Unknown scaling rule {rule!r}: choose one of {', '.join(RULES)}.")
    _check_positive("data_parallel", data_parallel)
    _check_positive("micro_batch_size", micro_batch_size)
    _check_positive("accumulate_grad_batches", accumulate_grad_batches)
    ref_lr = reference.lr if reference.lr is not None else lr
    ref_warmup = reference.warmup_steps if reference.lr is not None else warmup_steps
    if rule == "none":
        if lr is None:
            raise ValueError("scaling=none needs the configured lr.")
        gb = micro_batch_size * accumulate_grad_batches * data_parallel
        return EffectiveHparams(rule, data_parallel, micro_batch_size, accumulate_grad_batches, gb, lr, warmup_steps)
    if reference.global_batch_size is None or ref_lr is None:
        raise ValueError(f"scaling={rule} needs scaling.reference.global_batch_size and scaling.reference.lr.")
    _check_positive("reference.global_batch_size", reference.global_batch_size)
    ref_gb = reference.global_batch_size
    if rule == "fixed_global_batch":
        per_step = micro_batch_size * data_parallel
        if ref_gb % per_step:
            options = [m for m in range(1, ref_gb + 1) if ref_gb % (m * data_parallel) == 0][:6]
            raise ValueError(
                f"fixed_global_batch cannot reach the reference global batch {ref_gb} with micro-batch "
                f"{micro_batch_size} x data-parallel {data_parallel} = {per_step} per accumulation step. Use a "
                f"micro-batch (data.batch_size) such that micro x {data_parallel} divides {ref_gb}, e.g. {options}, "
                f"or a data-parallel size that divides {ref_gb // micro_batch_size if ref_gb % micro_batch_size == 0 else ref_gb}."
            )
        return EffectiveHparams(rule, data_parallel, micro_batch_size, ref_gb // per_step, ref_gb, ref_lr, ref_warmup)
    gb = micro_batch_size * accumulate_grad_batches * data_parallel
    ratio = gb / ref_gb
    new_lr = ref_lr * (ratio if rule == "linear" else math.sqrt(ratio))
    # Same number of warm-up samples: a larger global batch warms up in fewer steps.
    new_warmup = max(0, round(ref_warmup / ratio)) if ref_warmup else 0
    return EffectiveHparams(rule, data_parallel, micro_batch_size, accumulate_grad_batches, gb, new_lr, new_warmup)
