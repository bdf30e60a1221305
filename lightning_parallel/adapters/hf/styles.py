"""Tensor-parallel styles for Hugging Face plan entries that torch has no public style for.

``mla_kv_a_proj`` (multi-head latent attention: DeepSeek-V2/V3, GLM-4-MoE-Lite, MiniCPM3, LongCat): the
projection ``kv_a_proj_with_mqa`` stays whole on every rank and its output is split into a compressed part,
which feeds the column-sharded ``kv_b_proj`` (whose input gradient torch all-reduces already), and a rotary
part of ``qk_rope_head_dim`` features that goes straight into this rank's attention heads. That rotary part's
gradient is then one rank's heads only: :class:`MlaKvAProj` sums it over the tensor ranks in backward, so the
projection's weight gradient is one process's. The forward is unchanged (no communication).

``replicated_with_grad_allreduce`` (per-head norms between column- and row-sharded projections: Qwen3's, Gemma 3's
``q_norm``/``k_norm``): the weight stays whole and each rank's gradient covers its own heads only, so the ranks'
gradients are summed. :class:`SumGradientsOnUse` registers the summing hook on the parameters the module holds
when it runs, as transformers does: a model parallelised on ``meta`` gets new parameter objects when it is
materialised (``to_empty``), and a hook registered on the old ones would never fire (measured before: Qwen3's
``k_norm`` 4e-3 off one process after 4 steps under tensor 2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle


class _SumInBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _summed(group: Any) -> Any:
    def hook(grad: Tensor) -> Tensor:
        # A copy (a hook must not change the gradient autograd handed it), summed in fp32 whatever its dtype.
        total = grad.to(torch.float32, copy=True) if grad.dtype != torch.float64 else grad.clone()
        dist.all_reduce(total, group=group)
        return total.to(grad.dtype)

    return hook


class SumGradientsOnUse(ParallelStyle):
    """Whole parameters whose gradients are summed over the tensor ranks, hooked on the objects the forward uses."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hook, hooked = _summed(device_mesh.get_group()), {}

        def attach(mod: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            for name, param in mod.named_parameters():
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_hook(hook)
                    hooked[name] = param

        module.register_forward_pre_hook(attach)
        return module

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SumGradientsOnUse)

    def __hash__(self) -> int:
        return hash("SumGradientsOnUse")

    def __repr__(self) -> str:
        return "SumGradientsOnUse()"


class MlaKvAProj(ParallelStyle):
    """The whole ``kv_a_proj_with_mqa``; its last ``rope_dim`` output features' gradient summed over the ranks.

    Args:
        rope_dim: the config's ``qk_rope_head_dim`` (the rotary part at the end of the output).
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group, rope_dim = device_mesh.get_group(), self.rope_dim

        def local_input(mod: nn.Module, args: tuple) -> tuple:
            # Under sequence parallelism the parent hands a replicated DTensor: this projection is not sharded.
            first = args[0]
            return (first.to_local(), *args[1:]) if hasattr(first, "to_local") else args

        def split(mod: nn.Module, args: tuple, output: Tensor) -> Tensor:
            compressed, rotary = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([compressed, _SumInBackward.apply(rotary, group)], dim=-1)

        module.register_forward_pre_hook(local_input)
        module.register_forward_hook(split)
        return module

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MlaKvAProj) and other.rope_dim == self.rope_dim

    def __hash__(self) -> int:
        return hash(("MlaKvAProj", self.rope_dim))

    def __repr__(self) -> str:
        return f"MlaKvAProj(rope_dim={self.rope_dim})"
