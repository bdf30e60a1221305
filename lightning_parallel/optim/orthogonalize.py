"""Muon's orthogonalised update of matrices that live in shards: gathered, orthogonalised once, scattered back.

Newton-Schulz needs the whole matrix: its first step divides by the matrix's norm and every step multiplies it by
its own transpose, so a shard orthogonalised alone gives another update (the negative control in the tests shows
how far). Here each matrix's update is gathered over the mesh dimensions that cut its rows or columns, the iteration
runs on the whole matrix on one rank of the mesh -- matrices spread over the ranks in turn, so the work divides as
in torchtitan's and Dion's distributed Muon -- and each rank gets back its shard (a reduce-scatter of the owner's
result against zeros elsewhere: the same bytes as the gather). Matrices cut only along a leading batch dimension
(experts sharded over the expert axis) are whole on their rank already and orthogonalised there.

The iteration is torch's own (``torch.optim.Muon``): the same coefficients, bf16, the same ops in the same order, so
a layout gives one process's update; torch keeps it private, so it is written out here (checked against
``torch.optim.Muon`` in the tests).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = ["adjusted_lr", "newton_schulz", "orthogonalized_shards"]


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Orthogonalise ``update`` (``[m, n]``, or ``[..., m, n]`` matrix by matrix) as ``torch.optim.Muon`` does.

    Args:
        update: the momentum update, whole matrices.
        coefficients: the quintic iteration's ``(a, b, c)``.
        steps: iterations.
        eps: floor of the norm it divides by.
        dtype: the iteration's dtype: bf16 as torch's Muon (its rounding turns a 1e-7 difference in a gradient into
            a last-bit flip of the update, about 4e-3 of it), or fp32 where layouts are compared for exactness.
    """
    if update.dim() > 2:
        return torch.stack([newton_schulz(matrix, coefficients, steps, eps, dtype) for matrix in update])
    a, b, c = coefficients
    ortho = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Any) -> float:
    """``torch.optim.Muon``'s learning-rate scaling for a matrix of ``shape`` (its last two dimensions).

    Args:
        lr: the group's learning rate.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows / cols))``) or ``"match_rms_adamw"``.
        shape: the parameter's global shape.
    """
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _matrix_cut(parameter: Any) -> bool:
    """Whether a DTensor parameter's placements cut one of its last two (matrix) dimensions."""
    from torch.distributed.tensor import Shard

    last_two = (parameter.dim() - 2, parameter.dim() - 1)
    return any(isinstance(p, Shard) and p.dim % parameter.dim() in last_two for p in parameter.placements)


def _linear_rank(mesh: Any) -> int:
    coordinate, index = mesh.get_coordinate(), 0
    for size, position in zip(mesh.shape, coordinate):
        index = index * size + position
    return index


def orthogonalized_shards(parameters: list[Any], updates: list[Tensor], coefficients: tuple[float, float, float],
                          steps: int, eps: float, dtype: torch.dtype = torch.bfloat16) -> list[Tensor]:
    """The orthogonalised update of each parameter, as this rank's local part (values of ``dtype``).

    Args:
        parameters: the Muon parameters (plain tensors or DTensors), in the same order on every rank of a mesh.
        updates: this rank's local part of each parameter's momentum update.
        coefficients: the iteration's ``(a, b, c)``.
        steps: iterations.
        eps: floor of the norm.
        dtype: the iteration's dtype (:func:`newton_schulz`).
    """
    from torch.distributed.tensor import DTensor

    iterate = partial(newton_schulz, coefficients=coefficients, steps=steps, eps=eps, dtype=dtype)
    results: list[Optional[Tensor]] = [None] * len(parameters)
    batched: dict[int, list[int]] = {}  # FSDP2's or one tensor axis's cut: two collectives per mesh, not per matrix
    owned: dict[int, int] = {}
    for i, (parameter, update) in enumerate(zip(parameters, updates)):
        if not isinstance(parameter, DTensor) or not _matrix_cut(parameter):
            results[i] = iterate(update)  # whole on this rank (plain, replicated, or cut along experts only)
        elif _one_cut(parameter):
            batched.setdefault(id(parameter.device_mesh), []).append(i)
        else:  # several mesh axes cut it: one matrix at a time, handed out in turn over the mesh's ranks
            mesh = parameter.device_mesh
            turn = owned.get(id(mesh), 0)
            owned[id(mesh)] = turn + 1
            whole = DTensor.from_local(update, mesh, parameter.placements, run_check=False, shape=parameter.shape,
                                       stride=parameter.stride()).full_tensor()
            mine = turn % mesh.size() == _linear_rank(mesh)
            ortho = iterate(whole).float() if mine else torch.zeros_like(whole, dtype=torch.float32)
            results[i] = _scatter(ortho, parameter).to(dtype)
    for indices in batched.values():
        for i, local in zip(indices, _batched([parameters[i] for i in indices], [updates[i] for i in indices],
                                              iterate, dtype)):
            results[i] = local
    return results  # type: ignore[return-value]


def _one_cut(parameter: Any) -> bool:
    """A 2-D DTensor on a 1-D mesh cut along one dimension (FSDP2 over data, or one tensor-parallel axis)."""
    from torch.distributed.tensor import Shard

    return (parameter.dim() == 2 and parameter.device_mesh.ndim == 1
            and isinstance(parameter.placements[0], Shard))


def _chunks(size: int, ranks: int) -> list[int]:
    """Rows each rank holds of ``size`` cut ``ranks`` ways as DTensor and FSDP2 cut (``torch.chunk``)."""
    sizes = [len(c) for c in torch.arange(size).chunk(ranks)]
    return sizes + [0] * (ranks - len(sizes))


def _batched(parameters: list[Any], updates: list[Tensor], iterate: Any, dtype: torch.dtype) -> list[Tensor]:
    """Every matrix of one 1-D mesh at once: one all-gather of every rank's shards, each rank orthogonalises the
    matrices it owns (in turn), one all-gather of the results; each rank keeps its rows (or columns)."""

    mesh = parameters[0].device_mesh
    group, ranks, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    dims = [p.placements[0].dim % 2 for p in parameters]
    cuts = [_chunks(p.shape[d], ranks) for p, d in zip(parameters, dims)]
    sizes = [[c * p.shape[1 - d] for c in cut] for p, d, cut in zip(parameters, dims, cuts)]  # elements per rank
    gathered = _all_gather_flat([u.float().reshape(-1) for u in updates], [sum(s) for s in zip(*sizes)], group)
    owners = [i % ranks for i in range(len(parameters))]
    mine, offsets = [], [0] * ranks
    for i, (p, d, cut) in enumerate(zip(parameters, dims, cuts)):
        pieces = []
        for k in range(ranks):
            n = sizes[i][k]
            shape = (cut[k], p.shape[1]) if d == 0 else (p.shape[0], cut[k])
            pieces.append(gathered[k][offsets[k]:offsets[k] + n].view(shape))
            offsets[k] += n
        if owners[i] == me:
            mine.append(iterate(torch.cat(pieces, dim=d)).float().reshape(-1))
    totals = [sum(p.numel() for i, p in enumerate(parameters) if owners[i] == k) for k in range(ranks)]
    results = _all_gather_flat(mine, totals, group)
    locals_, offsets = [], [0] * ranks
    for i, (p, d, cut) in enumerate(zip(parameters, dims, cuts)):
        k = owners[i]
        whole = results[k][offsets[k]:offsets[k] + p.numel()].view(p.shape)
        offsets[k] += p.numel()
        start = sum(cut[:me])
        locals_.append(whole.narrow(d, start, cut[me]).to(dtype).contiguous())
    return locals_


def _all_gather_flat(tensors: list[Tensor], lengths: list[int], group: Any) -> list[Tensor]:
    """Each rank's ``tensors`` concatenated, gathered from every rank (``lengths``: each rank's total; padded to the
    longest, as gloo's all-gather wants equal sizes)."""
    import torch.distributed as dist

    longest = max(lengths) if lengths else 0
    flat = torch.cat(tensors) if tensors else torch.zeros(0)
    flat = torch.nn.functional.pad(flat, (0, longest - flat.numel()))
    out = [torch.empty(longest, dtype=flat.dtype, device=flat.device) for _ in lengths]
    dist.all_gather(out, flat, group=group)
    return out


def _scatter(ortho: Tensor, parameter: Any) -> Tensor:
    """This rank's part of the owner's result: a reduce over the mesh of the owner's matrix and everyone else's
    zeros, into the parameter's placements (fp32 on the wire: gloo has no bf16 reductions; bf16 values are exact)."""
    from torch.distributed.tensor import DTensor, Partial

    mesh = parameter.device_mesh
    partial = DTensor.from_local(ortho, mesh, [Partial()] * mesh.ndim, run_check=False, shape=parameter.shape,
                                 stride=parameter.stride())
    return partial.redistribute(mesh, parameter.placements).to_local()
