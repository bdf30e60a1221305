"""Grouped matrix multiply: ``x[rows of group g] @ w[g]`` for rows sorted by group, with a loop as the reference.

Note:
    torch's grouped GEMM (CPU and CUDA in torch 2.13) is private, so it reaches this
    module only as the ``kernel`` argument, from :mod:`lightning_parallel._compat`. It needs every row stride to
    be a multiple of 16 bytes and refuses a gradient with zero strides (the one ``y.sum()`` sends back), so
    :func:`grouped_mm` falls back to the loop when the shapes do not fit and hands the kernel a dense gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

#: ``kernel(x [m, k], w [G, k, n], offsets [G] int32 cumulative row counts) -> [m, n]``
Kernel = Callable[[Tensor, Tensor, Tensor], Tensor]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def loop_grouped_mm(x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    """The reference: one matrix multiply per group.

    Args:
        x: ``[m, k]`` rows sorted by group.
        weight: ``[G, k, n]``.
        counts: ``[G]`` rows per group (summing to ``m``).
    """
    pieces = x.split(counts.tolist())
    if not pieces:
        return x.new_zeros(0, weight.shape[-1])
    return torch.cat([piece @ weight[g] for g, piece in enumerate(pieces)])


def kernel_fits(x: Tensor, weight: Tensor) -> bool:
    """Whether the grouped GEMM kernel takes these operands (dtype, 16-byte row strides, contiguity, and at least one
    row: its backward fails on a rank that received no tokens).

    Args:
        x: ``[m, k]``.
        weight: ``[G, k, n]``.
    """
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, weight))
    return (aligned and x.shape[0] > 0 and x.dtype == weight.dtype and x.dtype in _KERNEL_DTYPES
            and x.is_contiguous())


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (the kernel's backward refuses zero strides)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_mm(x: Tensor, weight: Tensor, counts: Tensor, kernel: Optional[Kernel] = None) -> Tensor:
    """``x[rows of group g] @ weight[g]``: the kernel where it runs, else :func:`loop_grouped_mm`.

    Args:
        x: ``[m, k]`` rows sorted by group.
        weight: ``[G, k, n]``.
        counts: ``[G]`` rows per group.
        kernel: torch's grouped GEMM through ``_compat`` (None: the loop).
    """
    if kernel is None or not kernel_fits(x, weight):
        return loop_grouped_mm(x, weight, counts)
    offsets = counts.cumsum(0).to(torch.int32)
    return _DenseGrad.apply(kernel(x, weight, offsets))
