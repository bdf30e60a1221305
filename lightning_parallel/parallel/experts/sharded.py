"""An MoE block's experts sharded over an expert group, and the reduction their gradients need.

Note:
    Why plain local parameters and not DTensors: each rank's slice is an ordinary ``[E/ep, ...]`` parameter under
    the full module's attribute names (``blocks.1.mlp.experts.w_up``), so the expert math, optimizers and FSDP2
    over the expert-data group see plain tensors. A checkpoint that must reshard presents them as
    ``Shard(0)`` over the expert group (:func:`expert_range` says which rows a rank holds).

    Gradient reduction. The data ranks (``D`` of them, expert-parallel ranks included) each form a loss
    ``L_r`` and the suite averages dense gradients: the step's gradient is that of ``(1/D) sum_r L_r``. An expert
    slice held by rank ``r`` receives, through the all-to-all's backward, ``sum_{q in its expert group}
    dL_q/dW``. The ranks holding the same slice (one per expert group: the *expert-data* group) together cover
    every data rank once, so the exact gradient is ``(1/D) * sum over the expert-data group`` -- a sum, divided
    by all ``D`` data ranks, not by the expert-data group's size (torchtitan's gradient divide factor).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.experts.capacity import Capacity, global_keep
from lightning_parallel.parallel.experts.dispatch import combine_sorted, dispatch_sorted
from lightning_parallel.parallel.experts.grouped import Kernel, grouped_mm

EXPERT_WEIGHTS = ("w_up", "w_down")  # the grouped weights of the experts module, experts along dim 0


def expert_range(num_experts: int, group: dist.ProcessGroup) -> tuple[int, int]:
    """``(first, end)`` of the consecutive experts this rank holds in the expert group.

    Args:
        num_experts: ``E``.
        group: the expert group (``ep`` ranks; ``ep`` must divide ``E``).
    """
    return expert_block(num_experts, dist.get_world_size(group), dist.get_rank(group))


def expert_block(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """``(first, end)`` of the experts of rank ``rank`` of ``ep``: consecutive blocks of ``E/ep``.

    Args:
        num_experts: ``E``.
        ep: ranks of the expert group (must divide ``E``).
        rank: the rank in the expert group.
    """
    if num_experts % ep:
        raise ValueError(
            f"expert parallel size {ep} does not divide num_experts={num_experts}: pick ep among its divisors."
        )
    local = num_experts // ep
    return rank * local, (rank + 1) * local


class ExpertParallel(nn.Module):
    """Stands in for an MoE block's experts module, holding only this rank's ``E/ep`` experts.

    The experts module it replaces has ``num_experts``, grouped weights ``w_up``/``w_down`` (experts along dim 0),
    ``expert_mlp(x, counts, w_up, w_down, mm)`` and ``reset_parameters()``; the block calls
    ``keep(counts, tokens, capacity)`` then ``forward(rows sorted by expert, kept counts)``, on this as on it.

    Args:
        experts: the full-size experts module (on ``meta`` or with storage; moved to ``meta`` here, kept only
            as the template :meth:`reset_parameters` draws from).
        group: the expert group.
        capacity_group: the ranks whose batches together are the one-process batch that capacity is shared over
            (default ``group``; the whole data group when the expert group is a part of it).
        kernel: torch's grouped GEMM (through ``_compat``); None runs the loop.
        mesh: the expert group as a 1-D ``DeviceMesh``: the slices become ``Shard(0)`` DTensors of the full
            ``[E, ...]`` weights on it (what the strategies pass), so checkpoints hold every expert under its
            unsharded name and load under any expert size, the global gradient norm sums every rank's
            experts, and a ``meta``-built model materialises each rank's experts as one process initialises
            them. None: plain ``[E/ep, ...]`` tensors.
    """

    # Whether the running forward is one of the step's own (set by a pipelined run: torch also runs a stage once to
    # infer its shapes, which the first step's load report must not count -- it showed 1,536 copies for 1,024).
    counts_forward: Callable[[], bool] = staticmethod(lambda: True)

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup,
                 capacity_group: Optional[dist.ProcessGroup] = None, kernel: Optional[Kernel] = None,
                 mesh: Optional[Any] = None) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.first, self.end = expert_range(self.num_experts, group)
        self.group, self.capacity_group, self.kernel = group, capacity_group or group, kernel
        for name in EXPERT_WEIGHTS:
            local = getattr(experts, name).detach()[self.first:self.end]
            local = local if local.is_meta else local.clone()
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard

                full = getattr(experts, name)
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                           stride=full.stride())
            self.register_parameter(name, nn.Parameter(local))
        self.expert_mlp = experts.expert_mlp
        self._template = [experts.to("meta")]  # a list: not a submodule, so not among this module's parameters

    def reset_parameters(self) -> None:
        """This rank's slice of what the full module's ``reset_parameters()`` draws (same seed, same values)."""
        full = copy.deepcopy(self._template[0]).to_empty(device="cpu")
        full.reset_parameters()
        with torch.no_grad():
            for name in EXPERT_WEIGHTS:
                _local(getattr(self, name)).copy_(getattr(full, name)[self.first:self.end])

    def keep(self, counts: Tensor, tokens: int, capacity: Capacity) -> Tensor:
        """Copies kept per expert, decided over ``capacity_group`` as one process would (:func:`global_keep`).

        Args:
            counts: ``[E]`` this rank's copies routed to each expert.
            tokens: this rank's tokens in this forward.
            capacity: copies one expert takes from a batch of the given number of tokens.
        """
        return global_keep(counts, tokens, capacity, self.capacity_group)

    def _mm(self, x: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
        return grouped_mm(x, weight, counts, self.kernel)

    def record_load(self, local_counts: Tensor) -> None:
        """Add a training forward's rows per local expert to ``first_step_load`` until the load is reported (the
        start-up report of the first step, ``strategies/hybrid/expert_load_report.py``).

        Args:
            local_counts: ``[E/ep]`` rows that reached each of this rank's experts.
        """
        if self.training and not getattr(self, "load_reported", False) and self.counts_forward():
            previous = getattr(self, "first_step_load", None)
            counts = local_counts.detach().float()
            self.first_step_load = counts if previous is None else previous + counts

    def forward(self, rows: Tensor, counts: Tensor) -> Tensor:
        local, route = dispatch_sorted(rows, counts, self.group)
        self.record_load(route.local_counts)
        out = self.expert_mlp(local, route.local_counts, _local(self.w_up), _local(self.w_down), self._mm)
        # In the rows' dtype: under autocast a rank's matmuls give bf16 while a rank whose experts got no rows
        # gives the input's dtype, and the all-to-all back needs one element size on every rank.
        return combine_sorted(out.to(local.dtype), route, self.group)


def _local(tensor: Tensor) -> Tensor:
    """This rank's slice: a DTensor's local part (differentiable), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def expert_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every expert slice in ``module``: left out of the dense data-parallel reduction.

    Args:
        module: the model.
    """
    return [(f"{prefix}.{name}" if prefix else name, p)
            for prefix, m in module.named_modules() if isinstance(m, ExpertParallel)
            for name, p in m.named_parameters(recurse=False)]


def reduce_expert_gradients(module: nn.Module, expert_data_group: Optional[dist.ProcessGroup],
                            data_ranks: int) -> None:
    """Sum the expert slices' gradients over the expert-data group and divide by all data ranks (module Note).

    Args:
        module: the model, after backward.
        expert_data_group: the ranks holding the same experts (None when there is one).
        data_ranks: ``D``, the ranks dense gradients are averaged over (expert-parallel ranks included).
    """
    grads = [_local(p.grad) for _, p in expert_parameters(module) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all experts of the model
    if expert_data_group is not None and dist.get_world_size(expert_data_group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=expert_data_group)
    flat /= data_ranks
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))


def shard_experts_over_data(module: nn.Module, expert_data_mesh: Any, mp_policy: Optional[Any] = None) -> int:
    """FSDP2 over the expert-data group for every :class:`ExpertParallel` in ``module`` (``expert_data_shard``).

    Each rank's ``[E/ep, d, f]`` slices are cut again along their second dimension over the ranks holding the same
    experts (the first is the expert axis's already; a second cut there would be a strided shard that checkpoints
    and materialisation cannot name as one slice -- torchtitan's ``efsdp`` picks dim 1 for the same reason when
    ``E`` is small). FSDP2 gathers them for each forward and backward and reduce-scatters their gradients, averaged
    over the group; :func:`rescale_expert_gradients` then makes that average the module Note's sum over the group
    divided by all data ranks (FSDP2's own ``set_gradient_divide_factor`` would say it in one place, but reduces
    with ``PREMUL_SUM``, which gloo does not have).

    Args:
        module: the model, experts sharded over the expert axis already (before the dense FSDP2 units: FSDP2
            wraps children first).
        expert_data_mesh: the 1-D expert-data mesh (a child of the same root as the expert mesh).
        mp_policy: FSDP2's mixed-precision policy of the run (None: full precision).

    Returns:
        How many expert modules were wrapped.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    wrapped = 0
    for sub in module.modules():
        if isinstance(sub, ExpertParallel) and any(True for _ in sub.parameters(recurse=False)):
            fully_shard(sub, mesh=expert_data_mesh, reshard_after_forward=True,
                        mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
                        shard_placement_fn=lambda parameter: Shard(1))
            wrapped += 1
    return wrapped


def rescale_expert_gradients(module: nn.Module, factor: float) -> None:
    """Multiply every expert slice's (local) gradient by ``factor``: FSDP2's average over the ``G`` expert-data ranks
    times ``G / D`` is the exact gradient of the module Note (experts sharded by :func:`shard_experts_over_data`).

    Args:
        module: the model, after backward.
        factor: ``G / D`` (expert-data ranks over data ranks: ``1 / expert_parallel``).
    """
    with torch.no_grad():
        for _, parameter in expert_parameters(module):
            if parameter.grad is not None:
                _local(parameter.grad).mul_(factor)
