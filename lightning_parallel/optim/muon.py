"""Muon for the hidden matrices and AdamW for everything else, as one optimizer exact under every layout.

Muon's authors, torchtitan and Megatron train the 2-D hidden matrices (and each expert's matrices) with Muon and the
embeddings, the output head, norms and biases with AdamW. Lightning's automatic optimisation steps one optimizer, so
both live in one :class:`MuonWithAdamW` (Keller Jordan's ``MuonWithAuxAdam`` has the same shape): a parameter group
with ``use_muon=True`` is stepped by torch's Muon update, every other group by torch's own ``AdamW`` over the same
``state`` (so checkpoints, resharding and LR schedulers see one ordinary optimizer).

Under the suite's layouts a parameter may be a shard (FSDP2's ZeRO 2/3, tensor parallelism) of the matrix Muon has to
orthogonalise whole: the momentum is updated on the local shard (element-wise), the update is gathered, orthogonalised
once on one rank of the mesh and scattered back (:mod:`.orthogonalize`), and the step is applied to the shard. The
AdamW groups step on their local shards (:func:`~lightning_parallel.parallel.local_step.local_view`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.optim.orthogonalize import adjusted_lr, orthogonalized_shards

__all__ = ["MuonWithAdamW", "muon_groups"]

DEFAULT_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (its module keeps them private)


def _local(tensor: Any) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``use_muon=True``, AdamW on the others, in one optimizer (module docstring).

    Args:
        params: parameter groups (dicts; :func:`muon_groups` builds them), or parameters (then all AdamW).
        lr: Muon's learning rate.
        weight_decay: decay of groups that do not set their own.
        momentum: Muon's momentum. nesterov: Muon's Nesterov momentum.
        ns_coefficients: the Newton-Schulz iteration's ``(a, b, c)``. ns_steps: its iterations. ns_eps: its norm
            floor (torch's Muon calls it ``eps``; here ``eps`` is AdamW's, so that a recipe's AdamW settings carry
            over: ``model.optimizer._target_=lightning_parallel.optim.MuonWithAdamW model.optimizer.lr=0.02``).
        adjust_lr_fn: Muon's learning-rate scaling per matrix shape (``None``/``"original"``, ``"match_rms_adamw"``).
        ns_dtype: the Newton-Schulz iteration's dtype: ``"bfloat16"`` (torch's Muon) or ``"float32"`` (layouts then
            give one process's parameters to fp32 rounding; bf16 rounds a gradient's last-bit difference up to a
            flipped bit of the update).
        adamw_lr: the AdamW groups' learning rate (a group's own ``lr`` wins).
        betas: AdamW's betas. eps: AdamW's eps.

    Raises:
        ValueError: a Muon group holding a parameter that is not a matrix (2-D) or a stack of them (3-D: experts).
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
                 ns_steps: int = 5, ns_eps: float = 1e-7, adjust_lr_fn: Optional[str] = None, ns_dtype: str = "bfloat16",
                 adamw_lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "ns_steps": ns_steps, "ns_eps": ns_eps,
                    "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype, "use_muon": False, "betas": tuple(betas), "eps": eps}
        groups = [dict(g) for g in params] if _are_groups(params) else [{"params": list(params)}]
        for group in groups:
            if not group.get("use_muon", False):
                group.setdefault("lr", adamw_lr)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if group["use_muon"] and p.dim() not in (2, 3)]
            if bad:
                raise ValueError(f"Muon orthogonalises matrices, but a use_muon group holds parameters of shapes {bad}: "
                                 "put vectors, norms and biases in an AdamW group (muon_groups does).")
        self._adamw = self._make_adamw()

    def _make_adamw(self) -> torch.optim.AdamW:
        """torch's AdamW over the same group dicts and the same ``state`` (one optimizer from outside)."""
        adamw = torch.optim.AdamW([{"params": [torch.zeros(())]}])
        adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        for group in adamw.param_groups:  # AdamW's own keys (amsgrad, foreach, ...), at AdamW's defaults
            for key, value in adamw.defaults.items():
                group.setdefault(key, value)
        adamw.state = self.state
        return adamw

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._adamw = self._make_adamw()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step: AdamW on its groups (on local shards), Muon on its groups (matrices orthogonalised whole)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        from lightning_parallel.parallel.local_step import local_view

        self._adamw.state = self.state  # load_state_dict replaces self.state
        if self._adamw.param_groups:
            with local_view(self._adamw):
                self._adamw.step()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buffer = _local(p.grad), _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - group["momentum"])
            updates.append(grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer.clone())
        orthos = orthogonalized_shards(params, updates, group["ns_coefficients"], group["ns_steps"], group["ns_eps"],
                                       getattr(torch, group["ns_dtype"]))
        for p, ortho in zip(params, orthos):
            local = _local(p)
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def _are_groups(params: Iterable[Any]) -> bool:
    params = list(params) if not isinstance(params, list) else params
    return bool(params) and isinstance(params[0], dict)


def muon_groups(module: nn.Module, weight_decay: float = 0.1,
                exclude: Callable[[str], bool] = lambda name: False) -> list[dict[str, Any]]:
    """Parameter groups for :class:`MuonWithAdamW`: hidden matrices (``nn.Linear`` weights, experts' stacked
    matrices) by Muon, with decay; embeddings, ``exclude``\\ d names (the output head), norms and biases by AdamW,
    matrices with decay, vectors without.

    Groups hold the parameters the module holds now (a pipeline rank's stages only); empty groups are dropped.

    Args:
        module: the model (frozen parameters are left out).
        weight_decay: decay of the matrices.
        exclude: ``exclude(name)`` is true for a matrix AdamW must train (the output head, by its name).
    """
    embeddings = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    muon, adam_decay, adam_plain = [], [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() in (2, 3) and id(p) not in embeddings and not exclude(name):
            muon.append(p)
        else:
            (adam_decay if p.dim() >= 2 else adam_plain).append(p)
    groups = [{"params": muon, "use_muon": True, "weight_decay": weight_decay},
              {"params": adam_decay, "weight_decay": weight_decay}, {"params": adam_plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
