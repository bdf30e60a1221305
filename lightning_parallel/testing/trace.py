"""First divergence: on the first step where a layout leaves the tolerance, which module differs first.

The step is replayed on the reference and on the diverging layout with :class:`TraceRecorder`:
a forward hook on every named submodule keeps its output (pipeline micro-batches concatenated;
DTensors as full tensors), and before the optimizer step every parameter's gradient is gathered
by name. The parent merges each layout's ranks into full tensors -- data-parallel pieces along the
batch, tensor-parallel shards along the dimension that is split -- and walks the modules in the
reference's forward order: the first whose output differs is where the forward pass goes wrong
(a mask not split per micro-batch, a norm not reduced over the tensor group); if every output
matches, the first module *in backward order* whose gradient differs is where the backward goes
wrong, and a constant gradient ratio points at a loss normalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor


def _first_tensor(output: Any) -> Optional[Tensor]:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


def _full(value: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    value = value.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).to("cpu", torch.float64).clone()


class TraceRecorder(pl.Callback):
    """Records module outputs (first batch of ``step``) and parameter gradients (of ``step``) on this rank.

    Attributes:
        outputs: module name -> its outputs in call order (one per pipeline micro-batch).
        grads: parameter name -> full gradient.
        order: module names in the order their forward first ran.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.outputs: dict[str, list[Tensor]] = {}
        self.grads: dict[str, Tensor] = {}
        self.order: list[str] = []
        self._handles: list[Any] = []
        self._done = False

    def _hook(self, name: str) -> Any:
        def record(module: Any, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is not None:
                if name not in self.outputs:
                    self.order.append(name)
                self.outputs.setdefault(name, []).append(_full(tensor))

        return record

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and not self._done:
            self._handles = [m.register_forward_hook(self._hook(n)) for n, m in pl_module.named_modules() if n]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for handle in self._handles:
            handle.remove()
        self._done = self._done or bool(self._handles)
        self._handles = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            self.grads = {n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}

    def record(self, strategy: Any, rank: int) -> dict[str, Any]:
        """This rank's records with its (data, pipeline, tensor) coordinates."""
        layout = getattr(strategy, "layout", None)
        coords = tuple(layout.coordinates(rank)) if layout is not None else (rank, 0, 0)
        outputs = {n: torch.cat(v) if len(v) > 1 else v[0] for n, v in self.outputs.items()}
        return {"coords": coords, "outputs": outputs, "grads": self.grads, "order": self.order}


def _merge_tensor_shards(pieces: list[Tensor], target: torch.Size) -> Tensor:
    """Tensor-parallel pieces of one data-parallel replica: equal (replicated) or shards of one dimension."""
    first = pieces[0]
    if len(pieces) == 1 or all(p.shape == first.shape and torch.equal(p, first) for p in pieces):
        return first
    for dim in range(1, first.dim()):
        if first.shape[dim] * len(pieces) == target[dim]:
            return torch.cat(pieces, dim=dim)
    return first


def merge_outputs(records: list[dict[str, Any]], reference: dict[str, Tensor]) -> dict[str, Tensor]:
    """Module name -> the full-batch output, from every rank's pieces (see the module docstring)."""
    merged: dict[str, Tensor] = {}
    names = {n for r in records for n in r["outputs"]}
    for name in names:
        holders = sorted((r["coords"], r["outputs"][name]) for r in records if name in r["outputs"])
        target = reference.get(name, holders[0][1]).shape
        data_indices = sorted({c[0] for c, _ in holders})
        shard_target = torch.Size([target[0] // len(data_indices), *target[1:]]) if target else target
        # The trailing rows: a pipeline stage runs one extra forward first, to infer shapes.
        trimmed = [(c, t[-shard_target[0]:] if t.dim() and shard_target and t.shape[0] > shard_target[0] else t)
                   for c, t in holders]
        replicas = [_merge_tensor_shards([t for c, t in trimmed if c[0] == d], shard_target) for d in data_indices]
        merged[name] = torch.cat(replicas) if len(replicas) > 1 else replicas[0]
    return merged


def merge_grads(records: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Parameter name -> full gradient (the first rank that holds it: replicas agree after averaging)."""
    merged: dict[str, Tensor] = {}
    for record in sorted(records, key=lambda r: r["coords"]):
        for name, grad in record["grads"].items():
            merged.setdefault(name, grad)
    return merged


@dataclass
class Divergence:
    """The first module that differs on the traced step.

    Attributes:
        step: the traced optimizer step.
        layout: the diverging layout.
        module: the module's name (``""`` when nothing was found).
        kind: ``"output"`` or ``"gradient"``.
        difference: the largest absolute difference there.
        ratio: for a gradient, ``|grad| / |reference grad|`` (a constant ratio points at a loss normalisation).
        checked: modules compared.
    """

    step: int
    layout: str
    module: str
    kind: str
    difference: float
    ratio: float = math.nan
    checked: int = 0

    def describe(self) -> str:
        if not self.module:
            return (f"lp-compare trace: step {self.step}, {self.layout}: the {self.checked} module outputs and "
                    "gradients match; the difference is outside the modules (loss, optimizer, clipping)")
        text = (f"lp-compare trace: step {self.step}, {self.layout}: first differing module {self.module!r} "
                f"({self.kind}, max |Δ| {self.difference:.3e})")
        if self.kind == "gradient" and math.isfinite(self.ratio):
            text += f"; gradient norm ratio {self.ratio:.4f} to the reference"
        return text


def _param_grads(grads: dict[str, Tensor], module: str) -> list[str]:
    prefix = f"{module}."
    return [n for n in grads if n.startswith(prefix) and "." not in n[len(prefix):]]


def _grad_divergence(ref: dict[str, Tensor], run: dict[str, Tensor], order: list[str], tol: float) -> Optional[tuple]:
    for module in reversed(order):  # backward order: where the gradient first goes wrong
        names = [n for n in _param_grads(ref, module) if n in run and run[n].shape == ref[n].shape]
        if not names:
            continue
        diff = max(float((run[n] - ref[n]).abs().max()) for n in names)
        if diff > tol:
            ref_norm = math.sqrt(sum(float(ref[n].pow(2).sum()) for n in names))
            run_norm = math.sqrt(sum(float(run[n].pow(2).sum()) for n in names))
            return module, diff, run_norm / ref_norm if ref_norm else math.nan
    return None


def first_divergence(step: int, layout: str, ref: list[dict[str, Any]], run: list[dict[str, Any]],
                     tolerance: float) -> Divergence:
    """Compare the traced step of one layout (``run``: its ranks' records) with the reference's."""
    ref_outputs, ref_grads, order = ref[0]["outputs"], merge_grads(ref), ref[0]["order"]
    outputs, grads = merge_outputs(run, ref_outputs), merge_grads(run)
    checked = 0
    for name in order:
        if name not in outputs or outputs[name].shape != ref_outputs[name].shape:
            continue
        checked += 1
        expected = ref_outputs[name]
        diff = float((outputs[name] - expected).abs().max()) if expected.numel() else 0.0
        if diff > tolerance * max(1.0, float(expected.abs().max()) if expected.numel() else 1.0):
            return Divergence(step, layout, name, "output", diff, checked=checked)
    found = _grad_divergence(ref_grads, grads, order, tolerance)
    if found:
        module, diff, ratio = found
        return Divergence(step, layout, module, "gradient", diff, ratio, checked)
    return Divergence(step, layout, "", "", 0.0, checked=checked)
