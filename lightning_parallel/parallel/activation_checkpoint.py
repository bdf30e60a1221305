"""Activation checkpointing: recompute a layer's forward in backward instead of keeping its activations.

Step 3 of :func:`~lightning_parallel.parallel.compose.parallelize` (after tensor
parallelism, before FSDP2). The choice is a :class:`~lightning_parallel.parallel.options.ParallelOptions`
field, ``activation_checkpointing``:

* ``"none"`` -- nothing is recomputed;
* ``"full"`` -- every layer (the protocol's ``pipeline_layers()`` or a Hugging Face
  decoder's blocks; the units FSDP2 shards) keeps only its input; its whole forward runs
  again in backward;
* ``"selective"`` -- the same layers, but recomputation skips the outputs of the
  operations that cost FLOPs (see :data:`SAVED_OPERATIONS`);
* a list of globs (``["blocks.*.attn"]``) -- full recomputation of the submodules they name.

Note:
    How a layer is checkpointed. Every mode calls torch's public
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, preserve_rng_state=True)``:

    * non-reentrant, because ``torch.distributed.pipelining`` runs backward with
      ``autograd.backward``/``autograd.grad`` on stage outputs, which reentrant
      checkpointing does not support;
    * RNG state preserved, so dropout draws the same masks when recomputed and the losses
      equal those without checkpointing.

    The layer's class is swapped for a subclass whose ``forward`` calls the checkpoint
    (as FSDP2's ``fully_shard`` swaps classes). Not ``checkpoint_wrapper``: it inserts
    ``_checkpoint_wrapped_module.`` into parameter names, and the suite's checkpoints, plans
    and pipeline stages key on the unwrapped names. Not the names-preserving
    composable ``checkpoint`` (torch.distributed, a private module path): it needs
    torch's private ``_checkpoint_without_reentrant_generator`` to do the same.
    Parameter names, ``state_dict`` keys and module identities stay as they were, so the
    pipeline stages (which hold the very layer objects) and FSDP2 (applied after) see the
    checkpointed layers.

Note:
    What ``selective`` recomputes. It keeps the outputs of the matrix multiplications of
    linear layers (``mm``/``addmm``, the layer's FLOPs), of fused attention kernels and of
    tensor-parallel collectives (so recomputation sends nothing), and recomputes the rest:
    norms, activation functions, dropout masks, residual adds and the attention core when
    attention runs as separate operations (``bmm``, softmax, dropout on the ``s x s``
    scores: the memory that grows with the square of the sequence, for few FLOPs). This is
    Megatron-LM's selective recomputation (recompute the attention core) with torchtitan's
    op-level policy (save matmul and attention outputs). Whole-layer alternatives such as
    "every other block" halve the memory at half the recompute of ``full``; the op-level
    policy instead keeps the recompute cheap (no matmul runs twice) and saves the most where
    the sequence is long. Random operations are always recomputed, from the restored RNG
    state, so dropout stays exact.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Sequence
from typing import Any, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from lightning_parallel.parallel.pipeline.stages import RemovedLayer

MODES = ("none", "full", "selective")

Choice = Union[str, tuple[str, ...]]

# Pipeline schedules that run backward in two passes over each stage's graph (input, then weight gradients).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")

# Operations whose outputs `selective` keeps (by ATen name; those absent from this build are skipped).
SAVED_OPERATIONS = (
    "aten.mm", "aten.addmm",  # linear layers
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
    "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_gather_into_tensor",
)


def check_choice(value: Any) -> Choice:
    """A validated ``activation_checkpointing`` option: a mode name, or a tuple of submodule globs.

    Args:
        value: ``"none"``, ``"full"``, ``"selective"``, or a non-empty list of glob patterns.

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(
                f"activation_checkpointing={value!r} is not a mode: use one of {MODES}, or a list of submodule globs "
                "such as ['blocks.*.attn']."
            )
        return value
    if isinstance(value, Sequence) and value and all(isinstance(p, str) and p for p in value):
        return tuple(value)
    raise ValueError(
        f"activation_checkpointing={value!r} is neither a mode {MODES} nor a non-empty list of submodule globs "
        "(e.g. ['blocks.*.mlp'])."
    )


def check_schedule(choice: Choice, schedule: str) -> None:
    """Refuse ``selective`` under a pipeline schedule that splits backward in two (zero-bubble schedules).

    Note:
        Zero-bubble schedules run each stage's backward twice over the same graph, once for the
        input gradients and later for the weight gradients. Full recomputation stays exact there
        (tested under ``interleaved_zero_bubble`` and ``zbv``); torch's selective checkpointing
        hands out each kept output once and refuses a second backward over the region.

    Raises:
        ValueError: ``selective`` with a schedule of :data:`SPLIT_BACKWARD_SCHEDULES`.
    """
    if choice == "selective" and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ValueError(
            f"activation_checkpointing='selective' cannot run under schedule={schedule!r}: its split backward "
            "(input gradients, later weight gradients) passes twice over the recomputed region, which torch's "
            "selective checkpointing refuses. Fix: activation_checkpointing='full', or schedule='interleaved_1f1b'."
        )


def check_deepspeed_stage(choice: Choice, stage: int) -> Choice:
    """``choice``, unless it is ``selective`` under DeepSpeed ZeRO-3, where it was measured to change the losses.

    Note:
        With ZeRO-3's parameter gathering inside the recomputed region, torch's selective
        checkpointing drifted from the same run without checkpointing (3.4e-3 in the third
        step on the tiny GPT, dropout 0), while ``full`` and ZeRO-1/2 stayed exact. FSDP2's
        ZeRO-3 (the hybrid strategy's ``zero_stage=3``) is exact with ``selective``.

    Raises:
        ValueError: ``selective`` with ``stage=3``.
    """
    if choice == "selective" and stage == 3:
        raise ValueError(
            "activation_checkpointing='selective' is not exact under DeepSpeed ZeRO-3 (its losses drift from the run "
            "without checkpointing). Fix: activation_checkpointing='full', DeepSpeed stage 1 or 2, or "
            "HybridParallelStrategy(zero_stage=3, activation_checkpointing='selective') (FSDP2)."
        )
    return choice


def describe_choice(choice: Choice) -> str:
    """One line for the start-up table: the mode and what it recomputes."""
    if choice == "none":
        return "none"
    if choice == "full":
        return "full (every layer recomputes its forward in backward)"
    if choice == "selective":
        return "selective (layers keep matmul/attention outputs, recompute norms, activations, dropout)"
    return f"{', '.join(choice)} (full recomputation of these submodules)"


def saved_operations() -> list[Any]:
    """The operator overloads ``selective`` keeps (:data:`SAVED_OPERATIONS` present in this torch)."""
    found = []
    for name in SAVED_OPERATIONS:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return found


def selective_context() -> tuple[Any, Any]:
    """Fresh forward/recompute contexts for one checkpointed call under ``selective`` (torch's SAC)."""
    return create_selective_checkpoint_contexts(saved_operations())


def targets(module: nn.Module, choice: Choice, layers: Iterable[nn.Module]) -> list[nn.Module]:
    """The submodules of ``module`` that ``choice`` checkpoints (placeholders of other pipeline stages excluded).

    Args:
        module: the whole model (after the pipeline split and tensor parallelism).
        choice: a validated option (:func:`check_choice`).
        layers: the model's layers (what ``full`` and ``selective`` checkpoint).

    Raises:
        ValueError: a glob that names no submodule of ``module``.
    """
    if choice == "none":
        return []
    if isinstance(choice, str):
        chosen = list(layers)
    else:
        chosen = [m for _, m in matching_modules(module, choice)]
    return [m for m in chosen if not isinstance(m, RemovedLayer)]


def matching_modules(module: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` that the globs name, outermost only (a match inside another is dropped).

    Raises:
        ValueError: a glob that names no submodule (listing names it could have used) or a
            ``ModuleList``/``ModuleDict`` (never called, so nothing would be recomputed).
    """
    named = [(n, m) for n, m in module.named_modules() if n]
    chosen: dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = [(n, m) for n, m in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            examples = ", ".join(n for n, _ in named[:12])
            raise ValueError(
                f"activation_checkpointing glob {pattern!r} names no submodule of {type(module).__name__}: use "
                f"dotted names such as {examples} (fnmatch globs: 'blocks.*.attn'), or 'full'/'selective'."
            )
        containers = [n for n, m in hits if isinstance(m, (nn.ModuleList, nn.ModuleDict))]
        if containers:  # never called, so checkpointing it would recompute nothing
            raise ValueError(
                f"activation_checkpointing glob {pattern!r} names {containers[0]!r}, a container without forward: "
                f"name its entries instead ('{containers[0]}.*')."
            )
        chosen.update(hits)
    return [(n, m) for n, m in chosen.items() if not any(n.startswith(f"{outer}.") for outer in chosen)]


def apply_activation_checkpointing(modules: Iterable[nn.Module], selective: bool = False) -> list[nn.Module]:
    """Make each module recompute its forward in backward (see the module's notes); in place.

    Args:
        modules: the submodules to checkpoint (none nested inside another).
        selective: keep the outputs of :data:`SAVED_OPERATIONS` instead of recomputing everything.

    Returns:
        The modules, now checkpointed.

    Raises:
        ValueError: a module that is already checkpointed (it would recompute twice).
    """
    modules = list(modules)
    for m in modules:
        if is_checkpointed(m):
            raise ValueError(
                f"{type(m).__name__} is already activation-checkpointed: build a fresh module, or leave "
                "activation_checkpointing='none' when the model checkpoints itself."
            )
        m.__class__ = _checkpointed_class(type(m), selective)
    return modules


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs under the suite's activation checkpointing."""
    return isinstance(module, _Checkpointed)


class _Checkpointed:
    """Marker base of the swapped classes (their ``forward`` is built by :func:`_checkpointed_class`)."""


@functools.lru_cache(maxsize=None)
def _checkpointed_class(cls: type, selective: bool) -> type:
    """``cls`` with a ``forward`` that runs the original under non-reentrant checkpointing (one class per pair)."""
    original = cls.forward

    # The context function is passed only for selective checkpointing, and from this closure: torch.compile traces
    # checkpoint's context_fn only as a plain function it can see (a class attribute reaches it unresolved, and
    # dynamo refuses it), and the no-op default needs none.
    extra = {"context_fn": selective_context} if selective else {}

    @functools.wraps(original)  # keeps the signature: pipeline stages pass each layer the keywords it accepts
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        run = functools.partial(original, self)
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    prefix = "SelectiveCheckpointed" if selective else "Checkpointed"
    return type(f"{prefix}{cls.__name__}", (_Checkpointed, cls), {"forward": forward})
