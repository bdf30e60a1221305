"""Everything the engine asks of a model, in one object resolved once per run (:class:`ModelAdapter`).

The engine (:mod:`lightning_parallel.parallel`, the strategies and executors) never asks "is this a
Hugging Face model?": it asks the adapter it was given. This base class answers for a module
that follows :mod:`lightning_parallel.protocol` (its own ``pipeline_layers()``,
``tensor_parallel_plan()``, ``pipeline_split_batch()``, losses) and leaves everything else
empty. Adapters for model families (:mod:`lightning_parallel.adapters`: Hugging Face decoders
today; mixture-of-experts, context-parallel attention and embedding tables next) subclass it and
answer what the module leaves open; ``lightning_parallel.adapters.adapt(module)`` picks one.

Note:
    The class lives here, not in :mod:`lightning_parallel.adapters`, so that the import arrow
    points one way: adapters import the engine's vocabulary (plans, stages, styles) and
    implement this interface; the engine receives an instance as an argument and imports no
    adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Optional, Protocol

from torch import nn

from lightning_parallel.parallel.pipeline.plan import PipelinePlan, protocol_plan
from lightning_parallel.protocol import reset_parameters

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_parallel.parallel.context.plan import ContextGroup, SequenceSplit


class LossWeighting(Protocol):
    """Weights a model's own loss over data-parallel ranks while a training step runs."""

    def training(self) -> ContextManager[None]:
        """The context a training step runs in."""


class ModelAdapter:
    """The engine's questions about one model, answered from the module's protocol methods.

    Args:
        module: the LightningModule (or any ``nn.Module``) being parallelised.

    Attributes:
        module: that module.
    """

    #: Shown in start-up tables and messages: who answers for the model.
    kind = "protocol"

    #: Adapter classes for model families, asked in order by :meth:`resolve` (see :meth:`register`).
    families: ClassVar[list[type[ModelAdapter]]] = []

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @classmethod
    def for_module(cls, module: nn.Module) -> Optional[ModelAdapter]:
        """An adapter of this family for ``module``, or None when the family does not understand it.

        Subclasses override it; the base understands every module through the protocol.
        """
        return cls(module) if cls is ModelAdapter else None

    @staticmethod
    def register(family: type[ModelAdapter]) -> type[ModelAdapter]:
        """Add a model family's adapter class to those :meth:`resolve` asks (first registered, first asked).

        Note:
            A registry of classes, as Lightning's ``StrategyRegistry`` is, not run state: it is what
            lets the engine's functions resolve a model they were handed without an adapter and without
            importing :mod:`lightning_parallel.adapters` (which registers its families when imported,
            as ``import lightning_parallel`` does).
        """
        if family not in ModelAdapter.families:
            ModelAdapter.families.append(family)
        return family

    @staticmethod
    def resolve(module: nn.Module) -> ModelAdapter:
        """The adapter that answers for ``module``: the first registered family that understands it, else the
        protocol's (this class). Strategies call it once per run (``lightning_parallel.adapters.adapt``).

        Args:
            module: the LightningModule (or any module) to be parallelised.
        """
        for family in ModelAdapter.families:
            found = family.for_module(module)
            if found is not None:
                return found
        return ModelAdapter(module)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.module).__name__})"

    # Pipeline parallelism ------------------------------------------------------------------
    def pipeline_plan(self) -> PipelinePlan:
        """How the module splits into pipeline stages.

        Raises:
            ValueError: the module cannot be split (the message names what to define).
        """
        if callable(getattr(self.module, "pipeline_layers", None)):
            return protocol_plan(self.module)
        raise ValueError(
            f"{type(self.module).__name__} cannot be split into pipeline stages: it defines no pipeline_layers() and "
            "holds no Hugging Face model. Implement the module protocol (pipeline_layers and pipeline_loss_terms or "
            "pipeline_loss; see lightning_parallel/protocol.py and docs/protocol.md)."
        )

    def pipeline_step_hooks(self, stages: Sequence[nn.Module], layout: Any) -> tuple[Optional[Callable], ...]:
        """``(begin, end)``: what runs before and after each training schedule (:mod:`.pipeline.step_hooks`): the
        module's ``pipeline_step_begin``/``pipeline_step_end`` where it defines them (None where not).

        Args:
            stages: this rank's stage modules.
            layout: the run's :class:`~lightning_parallel.layout.ParallelLayout`.
        """
        return tuple(getattr(self.module, name, None) if callable(getattr(self.module, name, None)) else None
                     for name in ("pipeline_step_begin", "pipeline_step_end"))

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of one batch: the module's ``pipeline_split_batch``,
        else an ``(inputs, targets)`` pair.

        Args:
            batch: one batch from the data loader.
        """
        custom = getattr(self.module, "pipeline_split_batch", None)
        if callable(custom):
            return custom(batch)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise ValueError(
            f"Batches must be (inputs, targets) pairs, got {type(batch).__name__}"
            f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}. "
            "Return pairs from the dataset, or define pipeline_split_batch(batch) -> (inputs, targets) on the module."
        )

    # Tensor parallelism --------------------------------------------------------------------
    def tensor_plan(self, sequence_parallel: bool = False) -> tuple[str, dict[str, Any]]:
        """``(source, plan)``: the module's ``tensor_parallel_plan()`` (empty without one) and where it came from.

        Args:
            sequence_parallel: whether the plan should also shard the residual stream along the sequence
                (an adapter adds its entries; the protocol's own plan already says what it wants).
        """
        own = getattr(self.module, "tensor_parallel_plan", None)
        return "tensor_parallel_plan()", dict(own()) if callable(own) else {}

    def head_dimensions(self, plan: Mapping[str, Any]) -> list[tuple[str, int]]:
        """``(description, size)`` of dimensions ``plan`` splits that the layers' shapes do not show (head counts
        from a config); the engine finds the rest from the sharded layers themselves."""
        return []

    def untied_embeddings(self) -> Optional[str]:
        """A description of weights the model promises to tie but holds apart (None when all is well)."""
        return None

    def missing_plan_hint(self) -> str:
        """Extra words for the "nothing to shard" error (why the model brought no plan)."""
        return ""

    # Layers, units and roots ---------------------------------------------------------------
    def layers(self) -> list[nn.Module]:
        """The repeated blocks, in order: what ``activation_checkpointing="full"`` recomputes and what FSDP2 wraps
        one unit each without pipelining. The module's ``pipeline_layers()``, else none."""
        if callable(getattr(self.module, "pipeline_layers", None)):
            return list(self.module.pipeline_layers())
        return []

    def data_axis_roots(self) -> list[nn.Module]:
        """FSDP2 roots without pipelining, innermost first; the module itself is always the last."""
        return [self.module]

    def prepare_activation_checkpointing(self) -> None:
        """Make the model safe to recompute (an adapter turns off a key/value cache); nothing for the protocol."""

    # Context parallelism -------------------------------------------------------------------
    def check_context_parallel(self, method: str, size: int, tensor_size: int = 1) -> None:
        """Refuse, before any process starts, a model whose attention cannot be split along the sequence.

        The protocol's answer: the module's ``context_parallel_plan()`` must name its attention modules (and
        any position module) by globs that match (:mod:`lightning_parallel.parallel.context.plan`).

        Args:
            method: ``"ring"`` or ``"ulysses"``.
            size: the context-parallel size.
            tensor_size: the tensor-parallel size (heads a rank holds are divided by it too).
        """
        from lightning_parallel.parallel.context.plan import check_heads_of, matching_plan

        found = matching_plan(self.module, self._context_plan(), type(self.module).__name__)
        check_heads_of(self.module, found, method, size, tensor_size)

    def apply_context_parallel(self, model: nn.Module, context: ContextGroup) -> SequenceSplit:
        """Make ``model`` (this rank's share) attend across ``context``; returns how a batch is split for it.

        Args:
            model: the module after its pipeline split and tensor sharding.
            context: this rank's context group.
        """
        from lightning_parallel.parallel.context.plan import (
            SequenceSplit,
            apply_context_plan,
            matching_plan,
            split_pair_batch,
        )

        owner = type(self.module).__name__
        apply_context_plan(model, matching_plan(model, self._context_plan(), owner, whole=False), context)
        return SequenceSplit(context, lambda batch: split_pair_batch(batch, context, self.split_batch))

    def _context_plan(self) -> dict[str, str]:
        own = getattr(self.module, "context_parallel_plan", None)
        if not callable(own):
            raise ValueError(
                f"context_parallel_size > 1, but {type(self.module).__name__} defines no context_parallel_plan() and "
                "holds no Hugging Face decoder: name its attention modules ({'blocks.*.attn.core': 'attention'}, "
                "see docs/context-parallel.md), or set context_parallel_size=1."
            )
        return dict(own())

    # Expert parallelism --------------------------------------------------------------------
    def check_expert_parallel(self, size: int) -> None:
        """Refuse, before start, a model whose experts cannot be sharded ``size`` ways: the module's
        ``expert_parallel_plan()`` must name its experts modules, whose expert counts ``size`` divides.

        Args:
            size: the expert-parallel size.
        """
        from lightning_parallel.parallel.experts.plan import matching_experts

        matching_experts(self.module, self._expert_plan(size), type(self.module).__name__, size)

    def apply_expert_parallel(self, model: nn.Module, mesh: Any, token_group: Optional[dist.ProcessGroup],
                              kernel: Optional[Any] = None) -> list[str]:
        """Shard the experts modules ``model`` (this rank's share) holds over the expert mesh; returns their names.

        Args:
            model: the module after its pipeline split.
            mesh: the 1-D expert mesh.
            token_group: the data x context ranks, whose batches together are one process's (capacity).
            kernel: a grouped GEMM kernel, or None for the loop.
        """
        from lightning_parallel.parallel.experts.plan import apply_expert_plan, matching_experts

        size = mesh.size()
        names = matching_experts(model, self._expert_plan(size), type(self.module).__name__, size, whole=False)
        return apply_expert_plan(model, names, mesh, token_group, kernel)

    def _expert_plan(self, size: int) -> dict[str, str]:
        own = getattr(self.module, "expert_parallel_plan", None)
        plan = dict(own()) if callable(own) else {}
        if not plan:
            raise ValueError(
                f"expert_parallel_size={size}, but {type(self.module).__name__} names no experts "
                "(expert_parallel_plan() is missing or empty): build its mixture-of-experts layers (e.g. the GPT "
                "recipe's moe= settings) and name them, or set expert_parallel_size=1."
            )
        return plan

    # FP8 training --------------------------------------------------------------------------
    def high_precision_layers(self) -> dict[str, str]:
        """``{glob: why}`` of the Linear layers FP8 training leaves in high precision (:mod:`.float8`): the module's
        own ``float8_high_precision()`` where it defines one; else its first and last pipeline layers (the input
        projection, the output head) and mixture-of-experts routers (``*router``), as torchtitan keeps them."""
        own = getattr(self.module, "float8_high_precision", None)
        if callable(own):
            return dict(own())
        kept = {"*router": "MoE router"}
        layers = self.layers() or []
        names = {id(m): n for n, m in self.module.named_modules() if n}
        for layer, why in ((layers[:1], "input layer"), (layers[-1:], "output head")):
            if layer and id(layer[0]) in names:
                kept.update({names[id(layer[0])]: why, f"{names[id(layer[0])]}.*": why})
        return kept

    # Losses --------------------------------------------------------------------------------
    def check_batch_split(self, splits: list[str]) -> None:
        """Refuse, before start, a loss the layout would change: one that is not a mean over items, formed on
        each part of a split batch (a router's load-balancing loss). The protocol asks the module's own
        ``check_batch_split(splits)`` where it defines one.

        Args:
            splits: how the layout splits each batch, as settings (``["data_parallel_size=2"]``); empty: whole.
        """
        own = getattr(self.module, "check_batch_split", None)
        if callable(own):
            own(splits)

    def loss_weighting(
        self, group: Optional[dist.ProcessGroup], data_parallel_size: int, accumulate_grad_batches: int = 1,
        warn: bool = True,
    ) -> Optional[LossWeighting]:
        """How the model's own loss becomes the global-batch mean under data parallelism (None: it already is, or
        the module's ``training_step`` computes a loss the suite does not rewrite).

        Args:
            group: the data-parallel process group (None: the default group).
            data_parallel_size: ranks in ``group``.
            accumulate_grad_batches: the Trainer's gradient accumulation.
            warn: whether this rank prints warnings (``rank == 0``).
        """
        return None

    # Initialisation after building on meta --------------------------------------------------
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise ``module``'s own parameters and buffers in place (its copy, at full size, on the CPU).

        The protocol's answer is torch's convention, ``module.reset_parameters()``
        (:func:`~lightning_parallel.protocol.reset_parameters`).

        Args:
            name: the module's name in the unsplit model.
            module: the module (a copy of it) to initialise.
        """
        reset_parameters(name, module)

    # Checkpoints and weights ---------------------------------------------------------------
    def checkpoint_metadata(self) -> dict[str, Any]:
        """Extra top-level entries a checkpoint of this model carries (plain values only)."""
        return {}

    def weights_prefix(self) -> Optional[str]:
        """The attribute path (plus a dot) of pretrained weights inside the module, or None when it holds none."""
        return None
