"""Where each tensor of a Hugging Face model lies in a ``save_pretrained`` folder, matched as ``from_pretrained``
matches it, and how to read one rank's region of it without reading the rest.

transformers 5 stores some tensors otherwise than its modules hold them. The mixture-of-experts families write
one key per expert (``mlp.experts.0.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.0.w1.weight``) where
the module holds ``experts.gate_up_proj [E, 2I, H]``; a few families split or fuse projections, or rename keys.
``from_pretrained`` converts with the model's conversion mapping (``transformers/conversion_mapping.py``): each
key goes through every ``WeightRenaming``, then at most one ``WeightConverter``, whose operations merge a list of
per-expert tensors (``MergeModulelist``), concatenate (``Concatenate``), split (``Split``, ``Chunk``) or
transpose (``Transpose``). :func:`plan_sources` matches a folder's keys to the model's through that same mapping
(``lightning_parallel._compat``) and describes each model tensor as a small expression over stored keys --
:class:`Stored`, :class:`Stacked`, :class:`Joined`, :class:`Piece`, :class:`Swapped` -- whose shape comes from
the files' headers alone. ``expr.read(region, reader)`` reads only the stored slices ``region`` covers: a rank
holding 2 of 8 experts reads those 2 experts' keys; a tensor-parallel rank, its rows of each.

Note:
    The operations are interpreted here rather than run through transformers' converter objects because those
    take whole tensors; reading slices needs to know where each slice of the result comes from. An operation
    outside these five (``Interleave``, Inkling-2's own) is refused by name (:class:`UnreadableSource`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from lightning_parallel import _compat

#: ``((start, stop), ...)``: the part of a tensor a rank holds, one half-open range per dimension.
Region = tuple[tuple[int, int], ...]
#: ``reader(stored key, region) -> the stored tensor's region``.
Reader = Callable[[str, Region], Tensor]


def _with(region: Region, dim: int, span: tuple[int, int]) -> Region:
    return region[:dim] + (span,) + region[dim + 1:]


@dataclass(frozen=True)
class Stored:
    """One key of the folder, read as it is stored."""

    key: str
    shape: tuple[int, ...]

    def read(self, region: Region, reader: Reader) -> Tensor:
        """This key's ``region``."""
        return reader(self.key, region)

    def keys(self) -> list[str]:
        """The stored keys the expression reads."""
        return [self.key]


@dataclass(frozen=True)
class _Combined:
    """Several expressions combined along ``dim``."""

    dim: int
    parts: tuple[Source, ...]

    def keys(self) -> list[str]:
        """The stored keys the expression reads."""
        return [key for part in self.parts for key in part.keys()]


@dataclass(frozen=True)
class Stacked(_Combined):
    """``torch.stack(parts, dim)``: transformers' ``MergeModulelist`` (one stored tensor per expert)."""

    @property
    def shape(self) -> tuple[int, ...]:
        inner = list(self.parts[0].shape)
        return tuple(inner[:self.dim] + [len(self.parts)] + inner[self.dim:])

    def read(self, region: Region, reader: Reader) -> Tensor:
        """Only the parts (experts) inside ``region``'s range along ``dim``."""
        start, stop = region[self.dim]
        inner = region[:self.dim] + region[self.dim + 1:]
        return torch.stack([part.read(inner, reader) for part in self.parts[start:stop]], dim=self.dim)


@dataclass(frozen=True)
class Joined(_Combined):
    """``torch.cat(parts, dim)``: transformers' ``Concatenate`` (gate rows, then up rows)."""

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.dim] = sum(part.shape[self.dim] for part in self.parts)
        return tuple(shape)

    def read(self, region: Region, reader: Reader) -> Tensor:
        """Each part's overlap with ``region`` along ``dim``, concatenated."""
        start, stop = region[self.dim]
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                pieces.append(part.read(_with(region, self.dim, (low - offset, high - offset)), reader))
            offset += size
        return torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class Piece:
    """``part.narrow(dim, start, length)``: one target of transformers' ``Split`` or ``Chunk``."""

    dim: int
    start: int
    length: int
    part: Source

    @property
    def shape(self) -> tuple[int, ...]:
        return _with_size(self.part.shape, self.dim, self.length)

    def read(self, region: Region, reader: Reader) -> Tensor:
        """The part's region shifted by ``start`` along ``dim``."""
        low, high = region[self.dim]
        return self.part.read(_with(region, self.dim, (low + self.start, high + self.start)), reader)

    def keys(self) -> list[str]:
        """The stored keys the expression reads."""
        return self.part.keys()


@dataclass(frozen=True)
class Swapped:
    """``part.transpose(dim0, dim1)``: transformers' ``Transpose``."""

    dim0: int
    dim1: int
    part: Source

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.part.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(shape)

    def read(self, region: Region, reader: Reader) -> Tensor:
        """The part's region with the two dimensions exchanged, transposed back."""
        swapped = list(region)
        swapped[self.dim0], swapped[self.dim1] = region[self.dim1], region[self.dim0]
        return self.part.read(tuple(swapped), reader).transpose(self.dim0, self.dim1)

    def keys(self) -> list[str]:
        """The stored keys the expression reads."""
        return self.part.keys()


Source = Union[Stored, Stacked, Joined, Piece, Swapped]


def _with_size(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return shape[:dim] + (size,) + shape[dim + 1:]


class UnreadableSource(ValueError):
    """The conversion mapping stores a tensor through an operation the suite does not read in slices."""


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _alike(parts: list[Source], dim: int, what: str) -> None:
    """Refuse parts whose shapes differ outside ``dim`` (``None``: anywhere), naming their keys."""
    def outside(shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape if dim < 0 else shape[:dim] + shape[dim + 1:]

    shapes = {outside(part.shape) for part in parts}
    if len(shapes) > 1:
        listed = ", ".join(f"{part.keys()[0]} {tuple(part.shape)}" for part in parts[:4])
        raise ValueError(f"the folder's tensors for one {what} have different shapes ({listed}): the folder was not "
                         "written by save_pretrained of one model.")


def _one(value: Any) -> Source:
    return value[0] if isinstance(value, list) else value


def _apply(op: Any, state: dict[str, Any], sources: list[str], targets: list[str], first: str,
           known: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """One conversion operation on ``{pattern: expression or list}``, as transformers' ``op.convert`` names and
    combines them (see ``transformers/core_model_loading.py``)."""
    kind = type(op).__name__
    if kind == "MergeModulelist":
        out = {}
        for pattern, parts in state.items():
            name = targets[0] if len(state) == 1 else pattern
            parts = parts if isinstance(parts, list) else [parts]
            _alike(parts, -1, f"stack of {pattern!r}")
            out[name] = Stacked(_dim(op.dim, len(parts[0].shape) + 1), tuple(parts))
        return out
    if kind == "Concatenate" and len(targets) == 1:
        parts = [p for pattern in sources if pattern in state for p in
                 (state[pattern] if isinstance(state[pattern], list) else [state[pattern]])]
        dim = _dim(op.dim, len(parts[0].shape))
        _alike(parts, dim, f"concatenation into {targets[0]!r}")
        return {targets[0]: Joined(dim, tuple(parts))}
    if kind in ("Split", "Chunk") and len(state) == 1 and getattr(op, "num_shards_attribute", None) is None:
        return _split(op, _one(next(iter(state.values()))), targets, first, known, kind == "Chunk")
    if kind == "Transpose" and len(state) == 1:
        part = _one(next(iter(state.values())))
        name = sources[0] if len(targets) > 1 and len(sources) == 1 else targets[0]
        if op.check_dims and tuple(part.shape) == tuple(known.get(first, ())):
            return {name: part}
        return {name: Swapped(_dim(op.dim0, len(part.shape)), _dim(op.dim1, len(part.shape)), part)}
    raise UnreadableSource(f"{kind} (of {sources} -> {targets})")


def _split(op: Any, part: Source, targets: list[str], first: str, known: dict[str, tuple[int, ...]],
           equal: bool) -> dict[str, Source]:
    """``Split``: one piece per target, sized like the model's tensor; ``Chunk``: ``torch.chunk``'s pieces."""
    dim = _dim(op.dim, len(part.shape))
    total = part.shape[dim]
    if equal:
        step = math.ceil(total / len(targets))
        sizes = [max(0, min(step, total - i * step)) for i in range(len(targets))]
    else:
        names = [first.replace(targets[0], target, 1) for target in targets]
        if any(name not in known for name in names):
            raise ValueError(f"{part.keys()[0]!r} splits into {names}, which the model does not all hold.")
        sizes = [known[name][dim] for name in names]
    if sum(sizes) != total:
        raise ValueError(f"{part.keys()[0]!r} has {total} rows along dimension {dim}, the model's {targets} "
                         f"together {sum(sizes)}: the folder holds another configuration.")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return {target: Piece(dim, start, size, part) for target, start, size in zip(targets, starts, sizes)}


def _natural(key: str) -> list[tuple[Any, ...]]:
    """transformers' ``dot_natural_key`` order: expert ``2`` before ``10``, the order ``from_pretrained`` stacks in."""
    parts: list[tuple[Any, ...]] = []
    for part in key.split("."):
        text = part.rstrip("0123456789")
        digits = part[len(text):]
        parts.append((0, int(part)) if part.isdigit() else (1, text, int(digits)) if digits else (1, text))
    return parts


@dataclass
class SourcePlan:
    """How a folder's keys fill a model's tensors.

    Attributes:
        sources: ``{model key: expression over stored keys}``.
        unmatched: ``{stored key: the model key it was renamed to}`` for keys that fill no tensor of the model.
        unreadable: ``{model key: the operation}`` stored through an operation the suite does not read in slices.
    """

    sources: dict[str, Source]
    unmatched: dict[str, str]
    unreadable: dict[str, str]


def _converted(converter: Any, first: str, collected: dict[str, list[Stored]],
               known: dict[str, tuple[int, ...]]) -> dict[str, Source]:
    """The model keys one converter fills from the stored keys it collected for ``first`` (its first target)."""
    state: dict[str, Any] = dict(collected)
    sources, targets = list(converter.source_patterns), list(converter.target_patterns)
    for op in converter.operations:
        state = _apply(op, state, sources, targets, first, known)
    # As transformers' WeightConverter.convert: the pattern found in the first target name gives prefix and suffix.
    full = first.replace("*.", "0.")
    prefix, _, suffix = next((full.partition(k) for k in state if k in full), ("", "", ""))
    return {prefix + pattern + suffix: _one(value) for pattern, value in state.items()}


def plan_sources(model: Any, stored: dict[str, tuple[int, ...]], known: dict[str, tuple[int, ...]]) -> SourcePlan:
    """Match a folder's keys to a model's, as ``from_pretrained`` does (renamings, then at most one converter).

    Args:
        model: the transformers model whose conversion mapping applies (on ``meta``, parallelised or not).
        stored: ``{stored key: shape}`` of the folder (from the files' headers).
        known: ``{model key: full shape}`` of the tensors to fill (keys relative to ``model``).
    """
    conversions = _compat.hf_checkpoint_conversions(model)
    renamings = [c for c in conversions if not hasattr(c, "operations")]
    converters = [c for c in conversions if hasattr(c, "operations")]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    base = getattr(model, "base_model_prefix", None) or None
    plan = SourcePlan({}, {}, {})
    groups: dict[str, tuple[Any, dict[str, list[Stored]]]] = {}
    for key in sorted(stored, key=_natural):
        renamed, pattern = _compat.hf_rename_checkpoint_key(key, renamings, converters, base, known)
        if renamed not in known and key in known:
            renamed, pattern = key, None
        if renamed not in known:
            plan.unmatched[key] = renamed
        elif pattern is None:
            plan.sources.setdefault(renamed, Stored(key, tuple(stored[key])))
        else:
            converter, collected = groups.setdefault(renamed, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(Stored(key, tuple(stored[key])))
    for first, (converter, collected) in groups.items():
        try:
            plan.sources.update(_converted(converter, first, collected, known))
        except UnreadableSource as error:
            plan.unreadable[first] = str(error)
    return plan
