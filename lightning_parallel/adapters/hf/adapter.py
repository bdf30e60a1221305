"""The adapter for a LightningModule holding a Hugging Face ``transformers`` model (or being one).

It answers from the model's own plans and config what a module following the protocol would
say itself: pipeline stages from ``base_model_pp_plan`` (:mod:`.hf_pipeline`), the tensor plan
from ``tp_plan`` (:mod:`.hf_tensor`), head counts and tied embeddings from the config, the
decoder blocks as checkpointing and FSDP2 units, the causal-LM loss as token-weighted terms
(:mod:`.hf_loss`), and the ``hugging_face`` checkpoint entry ``lp-convert --to hf`` builds a
folder from. The module's own protocol methods always win over the model's answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from lightning_parallel.adapters.hf.model import causal_lm_loss_terms, causal_lm_valid_count, find_hf_model
from lightning_parallel.adapters.hf.context import (
    apply_hf_context,
    check_hf_context,
    shifted_loss_terms,
    shifted_valid_count,
)
from lightning_parallel.adapters.hf.experts import apply_hf_experts, check_hf_experts
from lightning_parallel.adapters.hf.init_weights import init_hf_module
from lightning_parallel.adapters.hf.loss import ACCUMULATION_WARNING, TokenWeightedLoss, group_sum, is_causal_lm
from lightning_parallel.adapters.hf.pipeline import HFStage, hf_pipeline_layers
from lightning_parallel.adapters.hf.router_loss import check_router_loss_split, has_router_loss, with_router_loss
from lightning_parallel.adapters.hf.router_pipeline import PipelinedRouterLoss
from lightning_parallel.adapters.hf.tensor import hf_head_dimensions, hf_tensor_plan, hf_untied_embeddings
from lightning_parallel.parallel.adapter import LossWeighting, ModelAdapter
from lightning_parallel.parallel.data import own_class
from lightning_parallel.parallel.pipeline.plan import PipelinePlan, defines_loss_terms, own_loss
from lightning_parallel.parallel.pipeline.runner import default_item_count

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_parallel.parallel.context.plan import ContextGroup, SequenceSplit

SAMPLE_SHAPE = (2, 8)  # the chain check's synthetic batch: tiny, with one padded row

#: The checkpoint entry ``lp-convert --to hf`` rebuilds a Hugging Face folder from
#: (:mod:`lightning_parallel.checkpoints.hf.export` reads it).
HF_KEY = "hugging_face"


def _sample_shape(model: nn.Module) -> tuple[int, int]:
    """:data:`SAMPLE_SHAPE`, its rows longer than a short sliding window so that a wrong window shows (at most 64)."""
    window = getattr(model.config, "sliding_window", None)
    rows, length = SAMPLE_SHAPE
    return rows, min(64, max(length, 2 * window + 2)) if isinstance(window, int) and window > 0 else length


def _sample(model: nn.Module) -> Callable[[], tuple[Any, Any]]:
    def run() -> tuple[Any, Any]:
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        shape = _sample_shape(model)
        input_ids = torch.randint(0, model.config.vocab_size, shape, generator=generator).to(device)
        attention_mask = torch.ones(shape, dtype=torch.long, device=device)
        attention_mask[1, -3:] = 0  # a padded row: the chain must apply the padding mask as forward does
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        return inputs, model(**inputs, use_cache=False).logits

    return run


def _by_targets(shifted: Callable[[], bool], already: Callable, unshifted: Callable) -> Callable:
    """``already`` while ``shifted()`` (targets are the whole sequence's ``shift_labels``), else ``unshifted``."""
    return lambda *args: already(*args) if shifted() else unshifted(*args)


def hf_plan(
    module: nn.Module, prefix: str, model: nn.Module, shifted: Callable[[], bool] = lambda: False
) -> PipelinePlan:
    """The pipeline plan of ``module`` holding the causal LM ``model`` at ``prefix`` (its own loss methods win).

    Args:
        module: the LightningModule.
        prefix: the model's attribute path in ``module`` (``""`` when it is the model).
        model: the ``transformers`` causal LM.
        shifted: whether the targets are already shifted, asked at every step (context parallelism, applied after
            the plan is made, passes each rank's share of the whole sequence's ``shift_labels``).

    Raises:
        ValueError: a model the pipeline cannot split (see :func:`~.hf_pipeline.check_hf_pipeline`).
    """
    named = hf_pipeline_layers(prefix, model)
    roles = {name: role for name, _, role in named}
    own = own_loss(module)
    return PipelinePlan(
        tuple(name for name, _, _ in named),
        tuple(layer for _, layer, _ in named),
        partial(HFStage, roles=roles, model=model),
        own or _by_targets(shifted, shifted_loss_terms, causal_lm_loss_terms),
        _by_targets(shifted, shifted_valid_count, causal_lm_valid_count) if own is None else default_item_count,
        type(model).__name__,
        _sample(model),
        loss_terms=own is None or defines_loss_terms(module),
        timeable=False,
    )


def hugging_face_entry(prefix: str, model: nn.Module) -> dict[str, Any]:
    """``{"prefix", "class", "config"}``: what ``lp-convert --to hf`` rebuilds the model's folder from.

    Plain values only (the config's ``to_dict()``), so ``meta.pt`` stays readable with ``weights_only=True``.
    """
    return {"prefix": prefix, "class": own_class(model).__name__, "config": model.config.to_dict()}


class HuggingFaceAdapter(ModelAdapter):
    """Answers for a module holding one ``transformers.PreTrainedModel``; its protocol methods still win.

    Args:
        module: the LightningModule.
        prefix: the model's attribute path in ``module`` (``""`` when ``module`` is the model).
        model: the Hugging Face model.
    """

    def __init__(self, module: nn.Module, prefix: str, model: nn.Module) -> None:
        super().__init__(module)
        self.prefix, self.model = prefix, model
        self.kind = type(model).__name__
        # Set by apply_context_parallel: a pipeline's targets are then the split batch's shift_labels.
        self.targets_shifted = False

    @classmethod
    def for_module(cls, module: nn.Module) -> Optional[HuggingFaceAdapter]:
        """The adapter when ``module`` holds one Hugging Face model (or is one), else None.

        Raises:
            ValueError: ``module`` holds two unrelated Hugging Face models and defines neither
                ``pipeline_layers()`` nor ``tensor_parallel_plan()``: the suite cannot tell which to split.
        """
        try:
            found = find_hf_model(module)
        except ValueError:
            if any(callable(getattr(module, name, None)) for name in ("pipeline_layers", "tensor_parallel_plan")):
                return None  # the module says itself how to split it: the protocol answers
            raise
        return cls(module, *found) if found is not None else None

    def pipeline_plan(self) -> PipelinePlan:
        if callable(getattr(self.module, "pipeline_layers", None)):
            return super().pipeline_plan()
        return hf_plan(self.module, self.prefix, self.model, lambda: self.targets_shifted)

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """A dict batch splits into ``(the dict without "labels", labels)``; else as the protocol says.

        Under context parallelism the targets are the batch's ``shift_labels`` (each rank's share of the whole
        sequence's next tokens) and the plan's loss does not shift them again.
        """
        if callable(getattr(self.module, "pipeline_split_batch", None)) or not isinstance(batch, Mapping):
            return super().split_batch(batch)
        if self.targets_shifted and "shift_labels" in batch:
            if own_loss(self.module) is not None:
                raise ValueError(
                    f"{type(self.module).__name__} defines its own pipeline loss, but under context parallelism a "
                    "Hugging Face batch's targets are each rank's share of the whole sequence's shift_labels, already "
                    "shifted: define pipeline_split_batch(batch) -> (inputs, targets) to choose them, or drop the "
                    "loss method and let the model's causal-LM loss be used."
                )
            return {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}, batch["shift_labels"]
        if "labels" not in batch:
            raise ValueError(
                f"The batch holds {sorted(batch)} but no 'labels': a Hugging Face causal LM's pipeline needs the "
                "labels as targets. Add labels to the batch (input_ids with -100 where no loss is taken), or define "
                "pipeline_split_batch(batch) -> (inputs, targets) on the module."
            )
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]

    def tensor_plan(self, sequence_parallel: bool = False) -> tuple[str, dict[str, Any]]:
        if callable(getattr(self.module, "tensor_parallel_plan", None)):
            return super().tensor_plan(sequence_parallel)
        source, plan = hf_tensor_plan(self.prefix, self.model, sequence_parallel=sequence_parallel)
        # transformers' "replicate" means what an unplanned module does.
        return source[0].upper() + source[1:], {key: value for key, value in plan.items() if value is not None}

    def head_dimensions(self, plan: Mapping[str, Any]) -> list[tuple[str, int]]:
        return hf_head_dimensions(self.model, dict(plan))

    def untied_embeddings(self) -> Optional[str]:
        return hf_untied_embeddings(self.model)

    def missing_plan_hint(self) -> str:
        return f"; it holds the Hugging Face {type(self.model).__name__}, whose config has no base_model_tp_plan"

    def layers(self) -> list[nn.Module]:
        """The module's ``pipeline_layers()``, else the decoder's blocks (gathered one at a time, as pipelined)."""
        own = super().layers()
        if own:
            return own
        blocks = getattr(getattr(self.model, "base_model", None), "layers", None)
        return list(blocks) if isinstance(blocks, nn.ModuleList) else []

    def data_axis_roots(self) -> list[nn.Module]:
        """The model first, then the module where it holds parameters outside the model.

        A zero-glue ``training_step`` calls ``self.model(**batch)`` and never the LightningModule's
        ``forward``, and FSDP2 gathers a root's own parameters in that root's forward: the model
        being called must be a root itself, or its embedding would stay sharded. FSDP2 takes the first unit
        to run forward for the root of everything under it, so a LightningModule unit above a model that
        trained first cannot run forward later (``predict_step`` calling ``self(...)``, the evaluation after
        ``lp-train``: "FSDP state has already been lazily initialized for model"); without parameters of its
        own it needs no unit, and its forward runs the model's.
        """
        if not self.prefix:
            return [self.module]
        inside = {id(p) for p in self.model.parameters()}
        own = any(id(p) not in inside for p in self.module.parameters())
        return [self.model, self.module] if own else [self.model]

    def check_context_parallel(self, method: str, size: int, tensor_size: int = 1) -> None:
        """The module's ``context_parallel_plan()`` when it has one; else the model must let its attention be
        replaced (:func:`~.hf_context.check_hf_context`)."""
        if callable(getattr(self.module, "context_parallel_plan", None)):
            return super().check_context_parallel(method, size, tensor_size)
        check_hf_context(self.model, method, size, tensor_size)

    def apply_context_parallel(self, model: nn.Module, context: ContextGroup) -> SequenceSplit:
        """The module's plan when it has one; else the model attends across ``context`` through an attention
        function of the run, and dict batches split with ``shift_labels`` and a mask descriptor
        (:mod:`.hf_context`)."""
        if callable(getattr(self.module, "context_parallel_plan", None)):
            return super().apply_context_parallel(model, context)
        self.targets_shifted = True
        return apply_hf_context(self.model, context)

    def check_expert_parallel(self, size: int) -> None:
        """The module's ``expert_parallel_plan()`` when it has one; else the model's own ``ep_plan`` must name experts
        the suite computes, ``size`` dividing their count (:func:`~.hf_experts.check_hf_experts`)."""
        if callable(getattr(self.module, "expert_parallel_plan", None)):
            return super().check_expert_parallel(size)
        check_hf_experts(self.model, size)

    def apply_expert_parallel(self, model: nn.Module, mesh: Any, token_group: Optional[dist.ProcessGroup],
                              kernel: Optional[Any] = None) -> list[str]:
        """The module's plan when it has one; else each experts module of the model's ``ep_plan`` that ``model``
        holds becomes this rank's share (:func:`~.hf_experts.apply_hf_experts`; dropless, so ``token_group``
        decides nothing)."""
        if callable(getattr(self.module, "expert_parallel_plan", None)):
            return super().apply_expert_parallel(model, mesh, token_group, kernel)
        return apply_hf_experts(model, self.prefix, mesh, kernel)

    def check_batch_split(self, splits: list[str]) -> None:
        """A model returning its router's load-balancing loss (``output_router_logits=True``) is refused under a
        split of the batch that would change it: that loss is not a token mean, so each part would form it from its
        own routing statistics (measured: 0.004 off one process under data 2, 0.04 under pipeline 2, where the
        stages' loss drops it). Data (and expert) splits of the families in ``hf_experts.CHECKED_FAMILIES`` are
        exact: :mod:`.hf_router_loss` sums the statistics over the ranks (see :meth:`loss_weighting`); so are
        pipeline splits under ``gpipe`` (:mod:`.hf_router_pipeline`)."""
        check_router_loss_split(self.model, splits)

    def pipeline_step_hooks(self, stages: Sequence[nn.Module], layout: Any) -> tuple[Optional[Callable], ...]:
        """The module's hooks, or for a model returning its router's balancing loss the hooks of
        :class:`~.hf_router_pipeline.PipelinedRouterLoss` over this rank's stages."""
        if callable(getattr(self.module, "pipeline_step_begin", None)) or not has_router_loss(self.model):
            return super().pipeline_step_hooks(stages, layout)
        loss = PipelinedRouterLoss(self.model, stages, layout.tensor_parallel)
        return loss.begin, loss.end

    def prepare_activation_checkpointing(self) -> None:
        # As Hugging Face's own gradient checkpointing does: a KV cache built during training would be
        # appended to again by the recomputation (selective checkpointing then fails in backward).
        if getattr(self.model.config, "use_cache", False):
            self.model.config.use_cache = False

    def loss_weighting(
        self, group: Optional[dist.ProcessGroup], data_parallel_size: int, accumulate_grad_batches: int = 1,
        warn: bool = True,
    ) -> Optional[LossWeighting]:
        """Token-weight a causal LM's own ``.loss`` over the data-parallel ranks (see :mod:`.hf_loss`), its router
        balancing term made global first when it returns one (:mod:`.hf_router_loss`); None with one data-parallel
        rank (transformers' per-batch mean is then the batch's token mean already)."""
        if data_parallel_size <= 1 or not is_causal_lm(self.model):
            return None
        if accumulate_grad_batches > 1 and warn:
            import warnings

            warnings.warn(ACCUMULATION_WARNING.format(accumulation=accumulate_grad_batches), stacklevel=2)
        weighting = TokenWeightedLoss(self.model, group_sum(group), data_parallel_size)
        return with_router_loss(self.model, weighting, group_sum(group), data_parallel_size)

    def high_precision_layers(self) -> dict[str, str]:
        """The output head (the model's output embeddings, ``lm_head``) and each MoE router (the ``gate``/``router``
        and a shared expert's gate beside an ``experts`` module); the module's ``float8_high_precision()`` wins."""
        if callable(getattr(self.module, "float8_high_precision", None)):
            return super().high_precision_layers()
        head, kept = self.model.get_output_embeddings(), {}
        for name, sub in self.module.named_modules():
            if head is not None and sub is head:
                kept[name] = "output head"
            if isinstance(getattr(sub, "experts", None), nn.Module):  # a sparse block: its routers
                kept.update({f"{name}.{child}": "MoE router" for child in ("gate", "router", "shared_expert_gate")
                             if isinstance(getattr(sub, child, None), nn.Module)})
        return kept

    def init_module(self, name: str, module: nn.Module) -> None:
        """The model's own per-module initialiser (``_init_weights``: its ``initializer_range``, norms to one, the
        rotary ``inv_freq`` from the config) inside the Hugging Face model; the protocol's outside it."""
        inside = not self.prefix or name == self.prefix or name.startswith(self.prefix + ".")
        if inside:
            inner = name[len(self.prefix) + 1:] if self.prefix else name  # the name inside the model ("": it)
            init_hf_module(self.model, inner, module)  # and constructor values where _init_weights sets none
        else:
            super().init_module(name, module)

    def checkpoint_metadata(self) -> dict[str, Any]:
        return {HF_KEY: hugging_face_entry(self.prefix, self.model)}

    def weights_prefix(self) -> Optional[str]:
        return self.prefix + "." if self.prefix else ""
