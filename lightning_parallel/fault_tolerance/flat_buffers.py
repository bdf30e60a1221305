"""One flat buffer per dtype for a list of tensors, and its pieces back: one cross-group collective per dtype instead
of one per tensor, shared by the gradient average (``mode=ddp``) and the parameter average (``mode=local_sgd``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flatten_by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, tuple[list[int], torch.Tensor]]:
    """``{dtype: (indices into tensors, a flat copy of those tensors in order)}``.

    Args:
        tensors: local tensors, in the same order on every group.
    """
    indices: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        indices.setdefault(tensor.dtype, []).append(i)
    return {dtype: (idx, torch.cat([tensors[i].reshape(-1) for i in idx])) for dtype, idx in indices.items()}


def pieces(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like`` (what :func:`flatten_by_dtype` put in, in order)."""
    return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in like]), like)]
