"""Which Linear layers train in FP8 and which stay in high precision, decided on the whole model (no torchao import).

A ``Linear`` layer computes in FP8 unless the model's adapter names it as one that must stay in high precision
(:meth:`~lightning_parallel.parallel.adapter.ModelAdapter.high_precision_layers`: the output head, MoE routers, ...),
or one of its matmul dimensions, as this rank computes it under tensor parallelism, is not a multiple of 16 (FP8
tensor cores need it; torch's scaled matmul refuses such shapes on the GPU). The choice is the same on every device,
so a CPU run (torchao's emulation) converts the layers a GPU run converts. Everything that is not a ``Linear`` --
embeddings, norms, the grouped expert weights of a mixture-of-experts layer -- stays in high precision anyway.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn

#: FP8 matmuls need every dimension of a layer's weight divisible by this.
MULTIPLE = 16


@dataclass(frozen=True)
class Float8Choice:
    """The FP8 decision for one model: what is converted, what is kept and why, and how it trains.

    Attributes:
        recipe: ``"tensorwise"`` or ``"rowwise"``.
        converted: names of the ``Linear`` layers that compute in FP8 (names of the unsplit model).
        kept: ``{name: why}`` of the ``Linear`` layers left in high precision.
        all_gather: FSDP2 all-gathers the converted weights in FP8 (tensorwise under ZeRO 2/3).
        tensor_styles: the tensor plan's column/row styles of converted layers become torchao's FP8 styles.
        emulated: the FP8 matmuls run as torchao's emulation (fp32 matmuls of FP8 values), off CUDA.
    """

    recipe: str
    converted: tuple[str, ...]
    kept: Mapping[str, str] = field(default_factory=dict)
    all_gather: bool = False
    tensor_styles: bool = False
    emulated: bool = False

    def notice(self, torchao_version: Optional[str] = None) -> str:
        """The one start-up line: how many layers train in FP8, and every layer left in high precision, with why."""
        how = [f"torchao {torchao_version}" if torchao_version else "torchao",
               "emulated (fp32 matmuls of FP8 values)" if self.emulated else "FP8 tensor cores"]
        if self.all_gather:
            how.append("FP8 all-gather under FSDP2")
        if self.tensor_styles:
            how.append("FP8 tensor-parallel styles")
        kept = "; ".join(f"{name} ({why})" for name, why in _grouped(self.kept).items()) or "none"
        return (f"lightning_parallel: float8 {self.recipe} ({', '.join(how)}): {len(self.converted)} Linear layers in "
                f"FP8; Linear layers kept in high precision: {kept}; embeddings, norms and grouped expert weights are "
                "not Linear layers and stay in high precision.")


def _grouped(kept: Mapping[str, str]) -> dict[str, str]:
    """``blocks.0.mlp.router``, ``blocks.1.mlp.router`` -> ``blocks.*.mlp.router`` (x2): a long model stays one line."""
    groups: dict[tuple[str, str], int] = {}
    for name, why in kept.items():
        key = (re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name), why)
        groups[key] = groups.get(key, 0) + 1
    return {(f"{pattern} x{count}" if count > 1 else pattern): why for (pattern, why), count in groups.items()}


def choose_float8_layers(module: nn.Module, adapter: Any, tensor_size: int = 1,
                         sharded: Optional[Mapping[str, Any]] = None) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(converted names, {kept name: why})`` for ``module`` (whole, on any device including ``meta``).

    Args:
        module: the whole model, before any split.
        adapter: its :class:`~lightning_parallel.parallel.adapter.ModelAdapter` (names the high-precision layers).
        tensor_size: the tensor-parallel size; the dimension a plan shards is checked as this rank holds it.
        sharded: the resolved tensor plan (``{name: ParallelStyle}``), or None without tensor parallelism.
    """
    named_kept = adapter.high_precision_layers()
    converted, kept = [], {}
    for name, layer in module.named_modules():
        if not isinstance(layer, nn.Linear) or not name:
            continue
        reason = next((why for pattern, why in named_kept.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if reason is None:
            reason = _shape_reason(layer, (sharded or {}).get(name), tensor_size)
        if reason is None:
            converted.append(name)
        else:
            kept[name] = reason
    return tuple(converted), kept


def _shape_reason(layer: nn.Linear, style: Any, tensor_size: int) -> Optional[str]:
    """Why the shapes of ``layer`` keep it in high precision (None: they fit FP8)."""
    out_features, in_features = layer.out_features, layer.in_features
    kind = type(style).__name__ if style is not None else ""
    if "Colwise" in kind:
        out_features //= tensor_size
    elif "Rowwise" in kind:
        in_features //= tensor_size
    if out_features % MULTIPLE or in_features % MULTIPLE:
        local = " per tensor rank" if kind else ""
        return f"{in_features}x{out_features}{local} not divisible by {MULTIPLE}"
    return None
