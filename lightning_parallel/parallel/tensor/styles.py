"""The suite's tensor-parallel style names and the torch ``ParallelStyle`` each one becomes.

A plan value is a name of :data:`STYLE_NAMES`, a torch ``ParallelStyle`` or ``None``;
:func:`to_style` turns a name into the style for one submodule and one choice of sequence
(``sp``) / loss (``lp``) parallelism. What each name becomes without / with ``sequence_parallel``:

* ``colwise`` -- ``ColwiseParallel()`` in both cases. Its input must be replicated: under
  sequence parallelism put ``gather_input`` on the parent that receives the stream.
* ``rowwise`` -- ``RowwiseParallel()`` (all-reduce) / output ``Shard(1)`` (reduce-scatter).
* ``rowwise_replicated_input`` -- ``rowwise`` whose input arrives whole (every rank slices
  its rows locally, no communication): after a ``colwise_gather`` projection.
* ``embedding_rowwise`` -- ``RowwiseParallel(input_layouts=Replicate())``, vocabulary rows
  sharded / output ``Shard(1)``: the embedding output *is* the residual stream.
* ``embedding_rowwise_replicated`` -- the same, but the output stays replicated under
  sequence parallelism too (something is added to it, or computed from its full length,
  before the stream starts).
* ``embedding_colwise`` -- embedding columns (features) sharded, output gathered.
* ``colwise_gather`` -- ``ColwiseParallel(output_layouts=Replicate())`` for an LM head /
  input ``Shard(1)``; with ``loss_parallel`` the output stays a ``Shard(-1)`` DTensor.
* ``sequence`` / ``sequence_local`` -- dropped / ``SequenceParallel()`` (norms, recognised by
  duck type: :func:`is_norm`); ``sequence_local`` hands on a local tensor, for norms whose
  output is added to the (local) residual stream.
* ``replicated_grad_sum`` -- parameters stay whole; their gradients are summed over the
  tensor ranks (a per-head norm that sees only this rank's heads).
* ``gather_input`` -- the first input (positional, or the keyword ``hidden_states``) marked
  replicated as a DTensor, so the projections inside share one input and its gradient is
  all-reduced once, not once per projection / all-gathered from ``Shard(1)`` on entry.
* ``scatter_input`` -- dropped / the first input sliced from replicated to ``Shard(1)``, a
  local slice with no communication (the first block of a stream that starts replicated).
* ``scatter_output`` -- dropped / ``PrepareModuleOutput(Replicate -> Shard(1))``, a local
  slice with no communication.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The sequence dimension of activations shaped (batch, sequence, features).
SEQ = 1
# The keyword Hugging Face blocks pass the residual stream by (``self_attn(hidden_states=...)``).
STREAM_KEYWORD = "hidden_states"


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` normalises the last dimension with at most a per-feature weight and bias.

    torch's ``LayerNorm``/``RMSNorm`` and ``Dropout``, any class whose name ends in ``RMSNorm``
    or ``LayerNorm`` (``LlamaRMSNorm``, ``OlmoLayerNorm``), or a leaf module with a 1-D
    ``weight``, an epsilon (``eps`` or ``variance_epsilon``) and no bias, as Hugging Face
    RMSNorms are written: each row is normalised on its own, so a sequence slice is exact.
    """
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Dropout)):
        return True
    if type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
        return True
    weight = getattr(module, "weight", None)
    has_eps = isinstance(getattr(module, "eps", getattr(module, "variance_epsilon", None)), float)
    return (
        isinstance(weight, nn.Parameter) and weight.ndim == 1 and has_eps
        and getattr(module, "bias", None) is None and not any(True for _ in module.children())
    )


class PrepareFirstInput(ParallelStyle):
    """Give a module's first input -- positional, or the keyword :data:`STREAM_KEYWORD` -- a layout.

    torch's ``PrepareModuleInput`` needs to know whether an input comes by position or by
    keyword; Hugging Face decoder layers call attention by keyword and the MLP by position,
    so this style takes whichever the call carries and leaves the other arguments alone.

    Args:
        input_layout: the layout the input has (a local tensor is read as this layout).
        desired_layout: the layout the module's body receives.
        use_local_output: hand on the local tensor instead of the DTensor.
    """

    def __init__(self, input_layout: Placement, desired_layout: Placement, use_local_output: bool) -> None:
        self.input_layouts = (input_layout,)
        self.desired_input_layouts = (desired_layout,)
        self.use_local_output = use_local_output

    def _convert(self, value: Any, mesh: DeviceMesh) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, self.input_layouts, run_check=False)
        if value.placements != self.desired_input_layouts:
            value = value.redistribute(placements=self.desired_input_layouts)
        return value.to_local() if self.use_local_output else value

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def prepare(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            if STREAM_KEYWORD in kwargs:
                return args, {**kwargs, STREAM_KEYWORD: self._convert(kwargs[STREAM_KEYWORD], device_mesh)}
            raise ValueError(
                f"{type(mod).__name__} was called with neither a positional input nor {STREAM_KEYWORD}=...: "
                "its gather_input/scatter_input plan entry cannot find the stream. Move the entry to the "
                "submodules that receive it."
            )

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (f"PrepareFirstInput({self.input_layouts[0]} -> {self.desired_input_layouts[0]}, "
                f"local={self.use_local_output})")


class SumGradients(ParallelStyle):
    """Keep a module's parameters whole and sum their gradients over the tensor ranks in backward.

    For a module that runs on this rank's share of a sharded dimension with a replicated
    weight -- a per-head norm between column- and row-sharded projections (Qwen3's
    ``q_norm``/``k_norm``) sees only this rank's heads -- so each rank's weight gradient is a
    partial sum; adding the ranks' partials gives the one-process gradient.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        import torch
        import torch.distributed as dist

        group = device_mesh.get_group()

        def summed(grad: Any) -> Any:
            # A copy (a hook must not change the gradient autograd handed it), summed in fp32
            # whatever the gradient's dtype (bf16 under bf16-true), as Megatron reduces in fp32.
            total = grad.to(torch.float32, copy=True) if grad.dtype != torch.float64 else grad.clone()
            dist.all_reduce(total, group=group)
            return total.to(grad.dtype)

        for param in module.parameters():
            if param.requires_grad:
                param.register_hook(summed)
        return module

    def __repr__(self) -> str:
        return "SumGradients()"


Factory = Callable[[bool, bool], Optional[ParallelStyle]]


def _colwise(sp: bool, lp: bool) -> ParallelStyle:
    # Also under sequence parallelism the input is expected replicated (a parent's
    # ``gather_input`` made it so). Declaring Shard(1) here would make torch insert a
    # Replicate->Replicate redistribute whose backward all-reduces the input gradient once
    # per projection instead of once per block (measured: +4 all-reduces per block).
    return ColwiseParallel()


def _rowwise(sp: bool, lp: bool) -> ParallelStyle:
    return RowwiseParallel(output_layouts=Shard(SEQ)) if sp else RowwiseParallel()


def _rowwise_replicated_input(sp: bool, lp: bool) -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQ) if sp else Replicate())


def _embedding_rowwise(sp: bool, lp: bool) -> ParallelStyle:
    # Token ids are replicated; each rank looks up its vocabulary rows and the partial
    # sums are reduced (all-reduce, or reduce-scatter straight into the sequence slice).
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQ) if sp else Replicate())


def _embedding_rowwise_replicated(sp: bool, lp: bool) -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _embedding_colwise(sp: bool, lp: bool) -> ParallelStyle:
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQ) if sp else Replicate())


def _colwise_gather(sp: bool, lp: bool) -> ParallelStyle:
    # Under loss parallelism the logits stay vocabulary-sharded DTensors, which
    # loss_parallel()'s cross-entropy consumes without ever gathering the vocabulary.
    return ColwiseParallel(
        input_layouts=Shard(SEQ) if sp else Replicate(),
        output_layouts=Shard(-1) if lp else Replicate(),
        use_local_output=not lp,
    )


def _sequence(sp: bool, lp: bool) -> Optional[ParallelStyle]:
    return SequenceParallel(sequence_dim=SEQ) if sp else None


def _sequence_local(sp: bool, lp: bool) -> Optional[ParallelStyle]:
    return SequenceParallel(sequence_dim=SEQ, use_local_output=True) if sp else None


def _gather_input(sp: bool, lp: bool) -> ParallelStyle:
    return PrepareFirstInput(Shard(SEQ) if sp else Replicate(), Replicate(), use_local_output=False)


def _scatter_input(sp: bool, lp: bool) -> Optional[ParallelStyle]:
    return PrepareFirstInput(Replicate(), Shard(SEQ), use_local_output=True) if sp else None


def _scatter_output(sp: bool, lp: bool) -> Optional[ParallelStyle]:
    if not sp:
        return None
    return PrepareModuleOutput(
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(SEQ),), use_local_output=True
    )


def _sum_gradients(sp: bool, lp: bool) -> ParallelStyle:
    return SumGradients()


def _any(module: nn.Module) -> bool:
    return True


# name -> (fits the module?, what fits in words, factory)
_LINEAR = (lambda m: isinstance(m, nn.Linear), "Linear")
_EMBEDDING = (lambda m: isinstance(m, nn.Embedding), "Embedding")
_STYLES: dict[str, tuple[Callable[[nn.Module], bool], str, Factory]] = {
    "colwise": (lambda m: isinstance(m, (nn.Linear, nn.Embedding)), "Linear / Embedding", _colwise),
    "rowwise": (*_LINEAR, _rowwise),
    "rowwise_replicated_input": (*_LINEAR, _rowwise_replicated_input),
    "embedding_rowwise": (*_EMBEDDING, _embedding_rowwise),
    "embedding_rowwise_replicated": (*_EMBEDDING, _embedding_rowwise_replicated),
    "embedding_colwise": (*_EMBEDDING, _embedding_colwise),
    "colwise_gather": (*_LINEAR, _colwise_gather),
    "sequence": (is_norm, "a norm (LayerNorm, RMSNorm or alike) / Dropout", _sequence),
    "sequence_local": (is_norm, "a norm (LayerNorm, RMSNorm or alike) / Dropout", _sequence_local),
    "replicated_grad_sum": (_any, "any module", _sum_gradients),
    "gather_input": (_any, "any module", _gather_input),
    "scatter_input": (_any, "any module", _scatter_input),
    "scatter_output": (_any, "any module", _scatter_output),
}

STYLE_NAMES: tuple[str, ...] = tuple(_STYLES)


def to_style(name: str, submodule: nn.Module, value: Any, sp: bool, lp: bool) -> Optional[ParallelStyle]:
    """The torch style of one plan entry (``None``: the entry does nothing in this mode).

    Args:
        name: the submodule's qualified name (for messages).
        submodule: the submodule the entry applies to.
        value: a name of :data:`STYLE_NAMES` or a torch ``ParallelStyle`` (returned as is).
        sp: sequence parallelism on.
        lp: loss parallelism on.

    Raises:
        ValueError: an unknown style name, or one that does not fit the submodule's type
            (the message lists the styles that fit).
    """
    if isinstance(value, ParallelStyle):
        return value
    if not isinstance(value, str) or value not in _STYLES:
        raise ValueError(
            f"Plan entry {name!r} has style {value!r}: use one of {', '.join(STYLE_NAMES)} or a torch ParallelStyle."
        )
    fits, what, factory = _STYLES[value]
    if not fits(submodule):
        kind = type(submodule).__name__
        others = [style for style, (style_fits, _, _) in _STYLES.items() if style_fits(submodule)]
        raise ValueError(
            f"Style {value!r} does not fit {name!r}, a {kind}: it applies to {what}. "
            f"Styles that fit a {kind}: {', '.join(others)}."
        )
    return factory(sp, lp)
