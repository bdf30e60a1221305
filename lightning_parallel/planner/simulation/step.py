"""One training step of a simulated rank, run on ``meta``: the collectives it issues and the activations it saves.

After :func:`~lightning_parallel.parallel.compose.parallelize` the rank runs forward, the model's loss and backward
on a ``meta`` batch of the configured size, through FSDP2, DTensor, context and expert parallelism exactly as a real
step does (FSDP2 let run on ``meta`` through :func:`lightning_parallel._compat.fsdp2_step_on_meta`), then the
experts' gradient reduction a real step runs after backward. Inside it:

- :class:`~.collectives.CountCollectives` counts every collective by kind, mesh axis and bytes;
- autograd's saved tensors are counted as :func:`torch.autograd.graph.saved_tensors_hooks` sees them (distinct
  storages, the parameters and FSDP2's gathered parameters left out: they are counted as parameters and
  ``gathered_bytes``), plus the inputs of activation-checkpointed layers, which checkpointing keeps for recomputation
  out of the hooks' sight;
- an MoE layer's token counts, which ``meta`` has no values for, are those of balanced routing
  (:class:`~.routing.BalancedRouting`): the experts' all-to-all dispatch runs with them.

Note:
    Not in the count: the model's own bookkeeping reductions inside ``training_step`` (a loss mean over ranks, logged
    metrics: scalars through the strategy's ``reduce``) and Lightning's. Pipelined layouts run their stages one
    micro-batch at a time in :mod:`.pipeline_step`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.planner.simulation.batches import batch_of, token_batch
from lightning_parallel.planner.simulation.collectives import CountCollectives, ddp_buckets, group_axes, summarize
from lightning_parallel.planner.simulation.routing import BalancedRouting

__all__ = ["StepRecord", "batch_of", "fused_attention", "run_step", "token_batch"]  # batch builders: .batches


@dataclass(frozen=True)
class StepRecord:
    """What one simulated step did.

    Attributes:
        collectives: ``{"kind", "axis", "count", "bytes"}`` per kind and mesh axis, in order of first call.
        activation_bytes: bytes autograd saved for backward (one batch of this rank; under pipelining, the
            micro-batches the schedule keeps in flight).
        details: further figures (pipelining: bytes per micro-batch and micro-batches in flight, per stage).
    """

    collectives: tuple[dict[str, Any], ...]
    activation_bytes: int
    details: dict[str, Any] = field(default_factory=dict)


def run_step(model: nn.Module, done: Any, meshes: Any, batch: Any, precision: str = "32-true") -> StepRecord:
    """Forward, loss and backward of ``batch`` on the parallelised ``model`` (the module docstring).

    Args:
        model: the parallelised model, on ``meta``.
        done: what ``parallelize`` returned (adapter, context split, options).
        meshes: the run's meshes (to name each collective's mesh axis).
        batch: one batch of this rank as the data loader gives it (before context parallelism splits it).
        precision: the Trainer's precision name (whether the data axis is DDP).
    """
    from lightning_parallel import _compat
    from lightning_parallel.parallel.tensor.plan import loss_parallel_context

    if done.context_split is not None:
        batch = done.context_split.split_batch(batch)
    inputs, targets = done.adapter.split_batch(batch)
    loss_fn = done.loss_fn or _loss_of(model, done.adapter)
    counter = CountCollectives(group_axes(meshes))
    saved = _SavedTensors(model, selective=done.options.activation_checkpointing == "selective")
    parallel_loss = loss_parallel_context(True) if done.options.loss_parallel else nullcontext()
    routing = BalancedRouting()  # inside the counter: the counts it gives are exchanged (and counted) as in a run
    # Fused attention in backward too: activation checkpointing recomputes the forward there.
    with _compat.fsdp2_step_on_meta(model), _compat.hf_masks_on_meta(), counter, parallel_loss, fused_attention():
        with routing:
            with saved.counting():
                loss = loss_fn(_forward(model, done.adapter, inputs), targets)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            loss.backward()
            _reduce_experts(model, meshes, done.options)
    calls = counter.calls + _ddp_calls(model, meshes, done.options, precision)
    return StepRecord(tuple(summarize(calls)), saved.total(), routing.details())


def _ddp_calls(model: nn.Module, meshes: Any, options: Any, precision: str) -> list[tuple[str, str, int]]:
    """DDP's bucket all-reduces where the data axis is torch's DDP (simulated without it: :mod:`.collectives`)."""
    from lightning_parallel.layout import DATA_CONTEXT, DATA_PARALLEL
    from lightning_parallel.parallel.replicated import replicates_plain

    layout = meshes.layout
    if not replicates_plain(layout, options, precision):
        return []
    axis = DATA_CONTEXT if layout.context_parallel_enabled else DATA_PARALLEL
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [("all_reduce", axis, size) for size in ddp_buckets(trainable, options.bucket_bytes)]


def _loss_of(model: nn.Module, adapter: Any) -> Any:
    """The loss of a whole (unpipelined) step: the adapter's pipeline plan's, else the module's ``pipeline_loss``
    (a module that cannot be split into stages but says how its loss is formed: the DLRM recipe)."""
    try:
        return adapter.pipeline_plan().loss_fn
    except ValueError:
        own = getattr(model, "pipeline_loss", None)
        if callable(own):
            return own
        raise


def _forward(model: nn.Module, adapter: Any, inputs: Any) -> Any:
    """The model's output for ``inputs``: a dict batch goes to the Hugging Face model the adapter found, as the
    recipe's ``training_step`` calls it (its keywords: ``position_ids`` under context parallelism, masks), else the
    module's ``forward``."""
    if isinstance(inputs, tuple):  # several inputs (the DLRM recipe: dense features and sparse ids)
        return model(*inputs)
    if not isinstance(inputs, Mapping):
        return model(inputs)
    inner = getattr(adapter, "model", None)
    output = inner(**inputs) if isinstance(inner, nn.Module) else model(**inputs)
    return getattr(output, "logits", output)


def _reduce_experts(model: nn.Module, meshes: Any, options: Any) -> None:
    """The real step's after-backward expert reduction (the hybrid strategy's ``ReduceExpertGradients``)."""
    from lightning_parallel.layout import EXPERT_DATA
    from lightning_parallel.parallel.experts.sharded import reduce_expert_gradients

    layout = meshes.layout
    if layout.expert_parallel <= 1:
        return
    sharded = options.expert_data_shard and layout.data_context // layout.expert_parallel > 1
    if not sharded:
        reduce_expert_gradients(model, meshes.group(EXPERT_DATA), layout.data_context)


@contextmanager
def fused_attention() -> Iterator[None]:
    """Inside, ``scaled_dot_product_attention`` on ``meta`` runs the fused (flash) kernel a device runs, not the math
    path.

    torch picks the math path for ``meta`` tensors, which saves the ``s x s`` attention weights for backward; the
    fused kernels of a GPU (and the CPU's flash kernel of a real CPU run) save the output and a log-sum-exp per query
    instead. Calls a fused kernel would not take (dropout, heads that do not group) and tensors not on ``meta`` run
    as they are. The function is swapped where models look it up (``torch.nn.functional``), not through a function mode:
    activation checkpointing's recomputation in backward must take the same path, and it runs outside a mode
    entered around the forward.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def attention(*args: Any, **kwargs: Any) -> Any:
        if not _fusable(*args, **kwargs):
            return original(*args, **kwargs)
        query, key, value = args[:3]
        if value.shape[-1] != query.shape[-1]:  # DeepSeek's MLA: values narrower than queries and keys
            return _FusedOnMeta.apply(query, key, value)
        output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, bool(kwargs.get("is_causal", False)), attn_mask=kwargs.get("attn_mask"),
            scale=kwargs.get("scale"))
        return output

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


class _FusedOnMeta(torch.autograd.Function):
    """A fused attention kernel on ``meta`` where torch's CPU flash kernel takes no narrower values: the output (the
    values' head size) and what the fused kernels save -- query, key, value, output and a log-sum-exp per query."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        ctx.save_for_backward(query, key, value, output, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        query, key, value = ctx.saved_tensors[:3]
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _fusable(query: Tensor, key: Tensor, value: Tensor, *rest: Any, **kwargs: Any) -> bool:
    """Whether an attention call is on ``meta``, given by keywords only, without dropout, with equal heads or grouped
    ones under ``enable_gqa`` (the fused kernels take the key/value heads unrepeated, as transformers asks them to
    when it passes no mask)."""
    heads = query.shape[-3] == key.shape[-3] or (kwargs.get("enable_gqa") and query.shape[-3] % key.shape[-3] == 0)
    return (query.device.type == "meta" and not rest and not kwargs.get("dropout_p") and bool(heads)
            and query.shape[:-3] == key.shape[:-3] and key.shape[:-2] == value.shape[:-2])


class _SavedTensors:
    """Bytes of the distinct storages autograd saves during a forward, parameters' storages left out.

    Activation checkpointing keeps, out of the hooks' sight, each checkpointed layer's inputs (counted by a
    pre-hook) and, under ``selective``, the outputs of the operators its policy saves (counted by a dispatch mode
    while a checkpointed layer runs its forward; the recomputation in backward is not counted).
    """

    def __init__(self, model: nn.Module, selective: bool = False) -> None:
        self.model, self.selective = model, selective
        self.storages: dict[int, int] = {}
        self.inside = 0  # checkpointed layers whose forward is running

    @contextmanager
    def counting(self) -> Iterator[None]:
        from lightning_parallel.parallel.activation_checkpoint import is_checkpointed

        def pack(tensor: Tensor) -> Tensor:
            self.add(tensor)
            return tensor

        def enter(module: nn.Module, args: tuple) -> None:
            self.inside += 1
            for value in args:  # checkpointing keeps a layer's inputs for its recomputation
                if isinstance(value, Tensor):
                    self.add(value)

        def leave(module: nn.Module, args: tuple, output: Any) -> None:
            self.inside -= 1

        layers = [m for m in self.model.modules() if is_checkpointed(m)]
        hooks = [h for m in layers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        kept = _KeptBySelective(self) if self.selective and layers else nullcontext()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), kept:
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def add(self, tensor: Tensor) -> None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if isinstance(local, nn.Parameter):
            return
        from lightning_parallel import _compat

        self.storages[_compat.storage_key(local)] = local.untyped_storage().nbytes()

    def total(self) -> int:
        """Saved bytes, without the storages of parameters and of FSDP2's gathered (unsharded) parameters."""
        return sum(size for key, size in self.storages.items() if key not in _parameter_storages(self.model))


class _KeptBySelective(_compat.dispatch_mode()):  # type: ignore[misc]
    """Counts the outputs selective checkpointing keeps: those of its saved operators inside a checkpointed layer."""

    def __init__(self, saved: _SavedTensors) -> None:
        from lightning_parallel.parallel.activation_checkpoint import saved_operations

        super().__init__()
        self.saved, self.operations = saved, set(saved_operations())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.saved.inside and func in self.operations:
            for value in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(value, Tensor):
                    self.saved.add(value)
        return out


def _parameter_storages(model: nn.Module) -> set[int]:
    """Storages of the parameters (local tensors) and of FSDP2's gathered parameters."""
    from lightning_parallel import _compat

    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {_compat.storage_key(t) for t in [*locals_, *_compat.fsdp2_gathered_tensors(model)]}
