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

Width rules (``scaling.width_rule``, with any of the above): ``standard`` uses the lr as it is at every width;
``mup`` (μP, :mod:`lightning_parallel.mup`) keeps it right as the model widens from ``model.base_width``: the
model trains its hidden matrices at lr x ``base_width / width`` and multiplies its logits by the same, so the lr
these rules produce is the embeddings' and vectors' lr at any width.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lightning_parallel.layout import ParallelLayout

RULES = ("none", "linear", "sqrt", "fixed_global_batch")
WIDTH_RULES = ("standard", "mup")


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
    """What a run actually uses after rescaling (``base_width``: μP's, under ``width_rule="mup"``)."""

    rule: str
    data_parallel: int
    micro_batch_size: int
    accumulate_grad_batches: int
    global_batch_size: int
    lr: float
    warmup_steps: int
    width_rule: str = "standard"
    base_width: Optional[int] = None

    def as_dict(self) -> dict:
        """The fields as a plain dict (for configs, loggers and ``metrics.json``)."""
        return asdict(self)

    def as_reference(self) -> Reference:
        """This run as a reference point.

        ``fixed_global_batch`` with this reference reproduces the run's global batch, lr and
        warm-up at any data-parallel size (what a run's saved ``effective.yaml`` offers).
        """
        return Reference(self.global_batch_size, self.lr, self.warmup_steps, self.data_parallel)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _indivisible_message(global_batch: int, micro_batch_size: int, data_parallel: int) -> str:
    """Why ``fixed_global_batch`` cannot reach ``global_batch``, and the values that would."""
    head = (
        f"fixed_global_batch cannot reach the reference global batch {global_batch} with micro-batch "
        f"{micro_batch_size} x data-parallel {data_parallel} = {micro_batch_size * data_parallel} "
        "per accumulation step."
    )
    if global_batch % data_parallel:
        sizes = [d for d in _divisors(global_batch) if d <= 4 * data_parallel][-6:]
        return (
            f"{head} The data-parallel size {data_parallel} does not divide {global_batch}: use a device count "
            f"(trainer.devices x num_nodes / pipeline / tensor) whose data-parallel size divides it, e.g. {sizes}, "
            f"or set scaling.reference.global_batch_size to a multiple of {data_parallel}, or use scaling=linear/sqrt."
        )
    micro = _divisors(global_batch // data_parallel)[-6:]
    return (f"{head} Use a micro-batch (data.batch_size) such that micro x {data_parallel} divides {global_batch}: "
            f"{micro}.")


def check_width_rule(width_rule: str, base_width: object, key: str = "model.base_width") -> None:
    """``width_rule`` and the model's base width must agree: ``mup`` needs one, ``standard`` must not be given one.

    Args:
        width_rule: ``standard`` or ``mup``.
        base_width: the model's base width (None: not set).
        key: where the config keeps it, for the messages.

    Raises:
        ValueError: an unknown rule, ``mup`` without a positive base width, or ``standard`` with one.
    """
    if width_rule not in WIDTH_RULES:
        raise ValueError(f"Unknown scaling.width_rule {width_rule!r}: choose one of {', '.join(WIDTH_RULES)}.")
    if width_rule == "standard" and base_width is not None:
        raise ValueError(f"{key}={base_width} asks for μP, but scaling.width_rule=standard: add scaling=mup (or "
                         f"scaling.width_rule=mup to the scaling rule you use), or drop {key}.")
    if width_rule == "mup" and (isinstance(base_width, bool) or not isinstance(base_width, int) or base_width < 1):
        raise ValueError(f"scaling.width_rule=mup needs {key}: the width the learning rate was tuned at, a positive "
                         f"integer (e.g. {key}=64, the reference run's width), not {base_width!r}.")


def rescale(
    rule: str,
    reference: Reference,
    data_parallel: int,
    micro_batch_size: int,
    accumulate_grad_batches: int = 1,
    lr: Optional[float] = None,
    warmup_steps: int = 0,
    *,
    width_rule: str = "standard",
    base_width: Optional[int] = None,
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
        width_rule: ``standard`` or ``mup`` (:func:`check_width_rule`); the lr is the same under both.
        base_width: the model's base width (``mup`` only).

    Raises:
        ValueError: unknown rule, missing reference values, a reference global batch that
            cannot be reached exactly, or a width rule and base width that disagree; the message names the fix.
    """
    if rule not in RULES:
        raise ValueError(f"Unknown scaling rule {rule!r}: choose one of {', '.join(RULES)}.")
    check_width_rule(width_rule, base_width)
    return replace(_rescale(rule, reference, data_parallel, micro_batch_size, accumulate_grad_batches, lr,
                            warmup_steps), width_rule=width_rule, base_width=base_width)


def _rescale(rule: str, reference: Reference, data_parallel: int, micro_batch_size: int,
             accumulate_grad_batches: int, lr: Optional[float], warmup_steps: int) -> EffectiveHparams:
    """:func:`rescale`'s batch rules."""
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
    resolved = Reference(reference.global_batch_size, ref_lr, ref_warmup, reference.devices)
    return _rescale_from_reference(rule, resolved, data_parallel, micro_batch_size, accumulate_grad_batches)


def _rescale_from_reference(
    rule: str, reference: Reference, data_parallel: int, micro_batch_size: int, accumulate_grad_batches: int
) -> EffectiveHparams:
    """The ``linear``, ``sqrt`` and ``fixed_global_batch`` rules from a complete, checked reference point."""
    ref_gb, ref_lr, ref_warmup = reference.global_batch_size, reference.lr, reference.warmup_steps
    if rule == "fixed_global_batch":
        per_step = micro_batch_size * data_parallel
        if ref_gb % per_step:
            raise ValueError(_indivisible_message(ref_gb, micro_batch_size, data_parallel))
        return EffectiveHparams(rule, data_parallel, micro_batch_size, ref_gb // per_step, ref_gb, ref_lr, ref_warmup)
    gb = micro_batch_size * accumulate_grad_batches * data_parallel
    ratio = gb / ref_gb
    new_lr = ref_lr * (ratio if rule == "linear" else math.sqrt(ratio))
    # Same number of warm-up samples: a larger global batch warms up in fewer steps.
    new_warmup = max(0, round(ref_warmup / ratio)) if ref_warmup else 0
    return EffectiveHparams(rule, data_parallel, micro_batch_size, accumulate_grad_batches, gb, new_lr, new_warmup)


def rescale_for_layout(
    rule: str,
    reference: Reference,
    layout: ParallelLayout,
    micro_batch_size: int,
    accumulate_grad_batches: int = 1,
    lr: Optional[float] = None,
    warmup_steps: int = 0,
    *,
    width_rule: str = "standard",
    base_width: Optional[int] = None,
) -> EffectiveHparams:
    """:func:`rescale` for a resolved layout: only its data-parallel size counts.

    Note:
        All ranks of a pipeline or tensor group work on the same samples, so a
        ``dp2 x pp2 x tp2`` layout on 8 devices has the global batch of ``dp2`` on 2
        devices. Passing ``world_size`` instead of ``data_parallel`` is the mistake this
        function exists to prevent.

    Args:
        rule: one of ``none``, ``linear``, ``sqrt``, ``fixed_global_batch``.
        reference: the tuned reference point.
        layout: the run's layout (``strategy.resolve_layout(devices x num_nodes)``).
        micro_batch_size: samples per data-parallel rank per forward/backward.
        accumulate_grad_batches: configured accumulation.
        lr: configured learning rate.
        warmup_steps: configured warm-up.
        width_rule: ``standard`` or ``mup``.
        base_width: the model's base width (``mup`` only).
    """
    return rescale(rule, reference, layout.data_parallel, micro_batch_size, accumulate_grad_batches, lr, warmup_steps,
                   width_rule=width_rule, base_width=base_width)


def lr_factor(rule: str, data_parallel: int, reference_data_parallel: int) -> float:
    """How ``rule`` scales the learning rate when ``data_parallel`` replicas of the same micro-batch and
    accumulation take a step that was planned for ``reference_data_parallel`` (the global batch scales with them).

    Args:
        rule: ``linear`` (proportional), ``sqrt``, or ``none``/``fixed_global_batch`` (unchanged: 1.0).
        data_parallel: replicas taking this step.
        reference_data_parallel: replicas the run's learning rate was set for.
    """
    _check_positive("data_parallel", data_parallel)
    _check_positive("reference_data_parallel", reference_data_parallel)
    ratio = data_parallel / reference_data_parallel
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule in ("none", "fixed_global_batch"):
        return 1.0
    raise ValueError(f"Unknown scaling rule {rule!r}: choose one of {', '.join(RULES)}.")
