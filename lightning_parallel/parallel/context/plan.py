"""Context parallelism applied to a module that follows the protocol: attention and positions replaced,
batches split along the sequence.

A module offers ``context_parallel_plan()``: submodule globs mapped to one of :data:`CONTEXT_STYLES`,

* ``"attention"`` -- a module whose ``forward(q, k, v)`` is scaled dot-product attention over
  ``[batch, heads, seq, head_dim]`` tensors (its ``is_causal`` attribute, default True, optional
  ``scale``, and ``num_heads``, which lets the all-to-all method's head count be checked before the run
  starts); it is replaced by :class:`ContextAttention`, which sees every rank's keys through the
  run's method (ring or all-to-all, :func:`~lightning_parallel.parallel.context.context_attention`);
* ``"positions"`` -- a module whose ``forward(x)`` returns the positions ``0..seq-1`` of ``x``'s tokens
  (dimension 1); it is replaced by :class:`ContextPositions`, which returns the *global* positions of
  the tokens this rank holds, so position embeddings and rotary angles are those of one process.

The replacements hold no parameters, so parameter names and checkpoints do not change with the context
size. The batch is split before the step (:func:`split_pair_batch`): each rank of a context group takes its
load-balanced share (head-tail chunks, :mod:`~lightning_parallel.parallel.context.sharding`) of every
sequence of the ``(inputs, targets)`` pair its data replica received. Targets are next-token targets aligned
with the inputs already (the recipes' datasets shift them), so splitting both the same way keeps each
token's target; a model that shifts labels inside its loss needs its adapter's splitter instead.

Note:
    Why module replacement and not torch's ``context_parallel`` context manager: that one patches
    ``F.scaled_dot_product_attention`` globally for CUDA kernels only and accepts no masks beyond causal;
    the replacement is local to the named modules, runs on gloo and takes the masks of
    :class:`~lightning_parallel.parallel.context.masks.AttentionMask`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import Tensor, nn

if TYPE_CHECKING:
    import torch.distributed as dist

CONTEXT_STYLES = ("attention", "positions")



@dataclass(frozen=True)
class ContextGroup:
    """This rank's context group: what splitting a sequence and attending across it need.

    Attributes:
        group: the context-parallel process group (None: the default group).
        size: ranks in it.
        rank: this rank's position in it.
        method: ``"ring"`` or ``"ulysses"``.
    """

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    method: str

    def positions(self, seq_len: int, device: Any = None) -> Tensor:
        """Global positions of this rank's share of a sequence of ``seq_len`` tokens."""
        from lightning_parallel.parallel.context.sharding import check_sequence, local_positions

        check_sequence(seq_len, self.size)
        return local_positions(seq_len, self.size, self.rank, device=device)

    def shard(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's share of ``tensor`` along ``dim`` (the sequence)."""
        from lightning_parallel.parallel.context.sharding import check_sequence, shard_sequence

        check_sequence(tensor.shape[dim], self.size)
        return shard_sequence(tensor, dim, self.size, self.rank)


@dataclass(frozen=True)
class SequenceSplit:
    """How a run under context parallelism splits batches and joins outputs (the adapter's answer).

    Attributes:
        context: this rank's context group.
        split_batch: ``batch -> this rank's share`` of every sequence in it.
    """

    context: ContextGroup
    split_batch: Callable[[Any], Any]

    def gather_outputs(self, output: Any) -> Any:
        """Whole sequences from every rank's share: tensors of two or more dimensions (and a model output's
        ``logits``) gathered along dimension 1, in global order (``predict``)."""
        from lightning_parallel.parallel.context.sharding import gather_sequence

        if isinstance(output, Tensor):
            return gather_sequence(output, 1, self.context.group) if output.dim() >= 2 else output
        if isinstance(output, (tuple, list)):
            return type(output)(self.gather_outputs(o) for o in output)
        if isinstance(output, Mapping):  # a transformers ModelOutput is one (and keeps its attributes in step)
            for key in [k for k, v in output.items() if isinstance(v, Tensor) and k != "loss"]:
                output[key] = self.gather_outputs(output[key])
        return output


class ContextAttention(nn.Module):
    """Scaled dot-product attention over the whole sequence, of which this rank holds a share.

    Args:
        replaced: the attention module it stands for (its ``is_causal`` and ``scale`` are kept).
        context: the run's context group.
    """

    def __init__(self, replaced: nn.Module, context: ContextGroup) -> None:
        super().__init__()
        self.is_causal = bool(getattr(replaced, "is_causal", True))
        self.scale = getattr(replaced, "scale", None)
        self.context = context

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        from lightning_parallel.parallel.context import AttentionMask, context_attention

        seq_len = q.shape[2] * self.context.size
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        return context_attention(self.context.method, q, k, v, self.context.positions(seq_len, q.device),
                                 AttentionMask(causal=self.is_causal), self.context.group, scale=scale)

    def extra_repr(self) -> str:
        return f"method={self.context.method}, size={self.context.size}, causal={self.is_causal}"


class ContextPositions(nn.Module):
    """The global positions of the tokens this rank holds (``x`` is ``[batch, local_seq, ...]``).

    Args:
        context: the run's context group.
    """

    def __init__(self, context: ContextGroup) -> None:
        super().__init__()
        self.context = context

    def forward(self, x: Tensor) -> Tensor:
        return self.context.positions(x.shape[1] * self.context.size, x.device)


def matching_plan(module: nn.Module, plan: Mapping[str, str], owner: str, whole: bool = True) -> dict[str, str]:
    """``{submodule name: style}`` for every submodule a glob of ``plan`` names.

    Args:
        module: the model.
        plan: ``{glob: style}``.
        owner: the class named in messages.
        whole: whether ``module`` is the whole model (every glob must match); a pipeline rank's share may
            hold no attention at all.

    Raises:
        ValueError: an unknown style, a glob that names no submodule, a plan naming no attention, an
            attention module with dropout (its random mask could not match one process's), or any ``nn.Dropout``
            with ``p > 0`` (each rank would draw the same mask for its share of the sequence).
    """
    names = [name for name, _ in module.named_modules() if name]
    found: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in CONTEXT_STYLES:
            raise ValueError(f"{owner}'s context_parallel_plan maps {pattern!r} to {style!r}: use one of "
                             f"{CONTEXT_STYLES}.")
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and whole:
            raise ValueError(f"{owner}'s context_parallel_plan pattern {pattern!r} matches no submodule: fix the "
                             f"glob (submodules look like {names[:4]}).")
        found.update(dict.fromkeys(hits, style))
    if whole and "attention" not in found.values():
        raise ValueError(f"{owner}'s context_parallel_plan names no 'attention' module: context parallelism "
                         "replaces attention, so name the modules computing it.")
    for name, style in found.items():
        if style == "attention" and float(getattr(module.get_submodule(name), "dropout", 0.0) or 0.0) > 0:
            raise ValueError(f"{owner}.{name} has attention dropout {module.get_submodule(name).dropout}: context "
                             "parallelism computes attention across ranks without dropout. Set the model's dropout "
                             "to 0.")
    dropouts = [f"{n} (p={m.p})" for n, m in module.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropouts:
        raise ValueError(f"{owner} has dropout {', '.join(dropouts[:3])}{', ...' if len(dropouts) > 3 else ''}: under "
                         "context parallelism each rank would draw its mask for its share of the sequence from the "
                         "same seed, neither one process's mask nor independent along the sequence. Set the model's "
                         "dropout to 0 (model.dropout=0 for the GPT recipe) for context parallelism.")
    return found


def check_heads_of(module: nn.Module, found: Mapping[str, str], method: str, size: int, tensor_size: int) -> None:
    """Under ``ulysses``, the heads each attention module holds per tensor rank must split over the context ranks
    (checked where the module says its ``num_heads``; else the first forward raises)."""
    if method != "ulysses":
        return
    from lightning_parallel.parallel.context import check_heads

    for name, style in found.items():
        heads = getattr(module.get_submodule(name), "num_heads", None)
        if style == "attention" and isinstance(heads, int):
            check_heads(heads, heads, size, tensor_size)


def apply_context_plan(module: nn.Module, found: Mapping[str, str], context: ContextGroup) -> list[str]:
    """Replace the submodules of ``found`` (from :func:`matching_plan`) that this rank holds; returns their names.

    Args:
        module: the model, after its pipeline split (a layer of another stage holds nothing to replace).
        found: ``{submodule name: style}``.
        context: the run's context group.
    """
    present = dict(module.named_modules())
    replaced = []
    for name, style in found.items():
        if name not in present:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = ContextAttention(present[name], context) if style == "attention" else ContextPositions(context)
        setattr(parent, child, new)
        replaced.append(name)
    return replaced


def split_pair_batch(batch: Any, context: ContextGroup, split: Callable[[Any], tuple[Any, Any]]) -> Any:
    """This rank's share of an ``(inputs, targets)`` batch: every tensor of two or more dimensions split
    along dimension 1 (the sequence), the container kept.

    Args:
        batch: one batch of the data loader.
        context: the run's context group.
        split: the adapter's ``split_batch`` (refuses batches that are not pairs).
    """
    inputs, targets = split(batch)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(
            "Context parallelism splits (inputs, targets) pair batches along the sequence, but the module splits its "
            "batches itself (pipeline_split_batch): return (inputs, targets) pairs from the dataset."
        )
    shares = [_shard_all(part, context) for part in (inputs, targets)]
    return type(batch)(shares)


def _shard_all(value: Any, context: ContextGroup) -> Any:
    if isinstance(value, Tensor):
        return context.shard(value, 1) if value.dim() >= 2 else value
    if isinstance(value, (tuple, list)):
        return type(value)(_shard_all(v, context) for v in value)
    if isinstance(value, Mapping):
        return {k: _shard_all(v, context) for k, v in value.items()}
    return value

