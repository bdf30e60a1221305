"""Grouped matrix multiply: the loop against a matmul per row, and when the kernel is used."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel import _compat
from lightning_parallel.parallel.experts import grouped_mm, kernel_fits, loop_grouped_mm

COUNTS = torch.tensor([3, 0, 5, 1])


def _operands(k: int = 8, n: int = 16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(COUNTS.sum()), k, generator=g, dtype=dtype)
    return x, torch.randn(len(COUNTS), k, n, generator=g, dtype=dtype)


def test_loop_equals_one_matmul_per_row_with_empty_groups():
    x, w = _operands()
    group = torch.repeat_interleave(torch.arange(len(COUNTS)), COUNTS)
    rows = torch.stack([x[i] @ w[g] for i, g in enumerate(group)])
    assert (loop_grouped_mm(x, w, COUNTS) - rows).abs().max() < 1e-6
    assert loop_grouped_mm(x[:0], w[:0], COUNTS[:0]).shape == (0, 16)


class _StrictKernel(torch.autograd.Function):
    """A stand-in for torch's kernel: the loop, refusing a gradient with zero strides as the real one does."""

    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
        return loop_grouped_mm(x, w, counts)

    @staticmethod
    def backward(ctx, grad):
        assert 0 not in grad.stride(), "the kernel got a gradient with zero strides"
        x, w, offsets = ctx.saved_tensors
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
        with torch.enable_grad():
            x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(loop_grouped_mm(x, w, counts), (x, w), grad)
        return dx, dw, None


def test_kernel_runs_where_shapes_fit_and_gets_a_dense_gradient():
    calls = []

    def kernel(x, w, offsets):
        calls.append(offsets.tolist())
        return _StrictKernel.apply(x, w, offsets)

    x, w = _operands()
    x.requires_grad_()
    grouped_mm(x, w, COUNTS, kernel).sum().backward()  # .sum() sends back a zero-stride gradient
    assert calls == [[3, 3, 8, 9]] and x.grad is not None
    odd_x, odd_w = _operands(k=6)
    assert not kernel_fits(odd_x, odd_w)  # 24-byte rows: the loop instead
    grouped_mm(odd_x, odd_w, COUNTS, kernel)
    assert len(calls) == 1


@pytest.mark.skipif(not hasattr(_compat, "grouped_mm"), reason="torch's grouped GEMM is not in _compat yet")
def test_torch_kernel_equals_the_loop_in_value_and_gradients():
    x, w = _operands()
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    x.requires_grad_(), w.requires_grad_()
    r = torch.randn(int(COUNTS.sum()), 16)
    (grouped_mm(x, w, COUNTS, _compat.grouped_mm) * r).sum().backward()
    (loop_grouped_mm(x_ref, w_ref, COUNTS) * r).sum().backward()
    assert (x.grad - x_ref.grad).abs().max() < 1e-5 and (w.grad - w_ref.grad).abs().max() < 1e-5
