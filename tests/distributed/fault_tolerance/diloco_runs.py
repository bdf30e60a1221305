"""Rank functions and the one-process replay for the DiLoCo tests (``fault_tolerance.mode=diloco`` and
``streaming_diloco``)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_parallel.fault_tolerance.gradient_average import average_gradients
from lightning_parallel.fault_tolerance.replica_state import local, module_state
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing.faults import FaultInjection, HoldWhileDegraded, incarnation
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset
from tests.distributed.fault_tolerance.replica_runs import (
    BATCH,
    DEPTH,
    LAYOUTS,
    SAMPLES,
    WIDTH,
    CommittedBatches,
    full_state,
)

# The layouts a group may take here: the fault-tolerance tests' and ZeRO-3 over a data axis of 2 inside each group.
DILOCO_LAYOUTS = {**LAYOUTS, "zero 3": {"data_parallel_size": 2, "zero_stage": 3}}


class _Sent:
    def __init__(self) -> None:
        self.bytes = 0

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Any:
        self.bytes += tensor.numel() * tensor.element_size()
        return _Done()


class _Done:
    def wait(self) -> None:
        """Nothing travelled."""


class Meetings(Callback):
    """After every meeting: this rank's parameters and outer state; through the run: the bytes its manager's
    all-reduces sent across groups (the torchft manager's ``allreduce`` wrapped with a counter)."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, Any]] = []
        self.before: list[dict[str, Any]] = []
        self.bytes = 0
        self.steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        manager = trainer.strategy.replica_groups.manager
        send = manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return send(tensor, *args, **kwargs)

        manager.allreduce = counted
        outer = trainer.strategy.replica_groups.outer
        if outer is None:  # mode=ddp: only the bytes are counted
            return
        start = outer.start

        def noted(*args: Any, **kwargs: Any) -> Any:  # this rank's shards as the exchange starts
            self.before.append({"params": [local(p.data).clone() for p in outer.params],
                                "originals": [t.clone() for t in outer.originals],
                                "outer": copy.deepcopy(outer.outer.state_dict())})
            return start(*args, **kwargs)

        outer.start = noted
        if trainer.global_step > 0 and not outer.pending:  # restarted: healed at the others' meeting, joined it
            self._snapshot(trainer, pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.steps += 1
        outer = trainer.strategy.replica_groups.outer
        if outer is not None and outer.fragment_at(trainer.global_step) is not None:
            self._snapshot(trainer, pl_module)

    def _snapshot(self, trainer: Any, pl_module: Any) -> None:
        outer = trainer.strategy.replica_groups.outer
        self.snapshots.append({"step": trainer.global_step, "outer": copy.deepcopy(outer.state_dict()),
                               "local": full_state(pl_module),  # DTensors gathered inside the group
                               "shards": [local(p.data).clone() for p in outer.params],
                               "committed": outer.meetings[-1]["committed"],
                               "fragment": outer.meetings[-1]["fragment"]})


def ddp_bytes_per_step(module: torch.nn.Module) -> int:
    """What ``mode=ddp`` sends across groups per step from this rank: its own per-step payload (the gradients and
    the presence flags and stop vote beside them) counted through a manager that only counts."""
    sent = _Sent()
    average_gradients(sent, [p for p in module.parameters() if p.requires_grad], (0.0,))
    return sent.bytes


def diloco_rank(rank: int, world_size: int, layout: str, steps: int, faults: tuple, ft: dict,
                folder: str) -> dict[str, Any]:
    """One rank of one replica group: ``steps`` steps of the residual MLP (AdamW) under ``ft``; what it met."""
    pl.seed_everything(0, verbose=False)
    model = ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    recorder, meetings = CommittedBatches(Path(folder)), Meetings()
    strategy = HybridParallelStrategy(**DILOCO_LAYOUTS[layout], fault_tolerance=ft)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
                         callbacks=[FaultInjection(*faults), HoldWhileDegraded(1.0), recorder, meetings],
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=FixedOrderData(regression_dataset(SAMPLES, WIDTH), BATCH))
    outer = strategy.replica_groups.outer
    if outer is None:  # mode=ddp
        return {"bytes": meetings.bytes, "steps": meetings.steps, "ddp_bytes_per_step": ddp_bytes_per_step(model)}
    return {"group": int(os.environ["REPLICA_GROUP_ID"]), "incarnation": incarnation(), "records": recorder.records,
            "snapshots": meetings.snapshots, "before": meetings.before, "bytes": meetings.bytes,
            "steps": meetings.steps, "ddp_bytes_per_step": ddp_bytes_per_step(model), "meetings": outer.meetings,
            "fragments": outer.fragment_names(), "fragment_names": outer.fragment_names(), "names": outer.names,
            "local": module_state(model), "outer": outer.state_dict(),
            "global_step": trainer.global_step}


def diloco_moe_rank(rank: int, world_size: int, steps: int, ft: dict) -> dict[str, Any]:
    """One rank of a group of data 2 x expert 2: the GPT recipe's MoE blocks (4 experts, top-2), AdamW."""
    from tests.distributed.parity_runs import text_dataset, tiny_gpt

    pl.seed_everything(0, verbose=False)
    model = tiny_gpt(moe={"every": 2, "num_experts": 4, "top_k": 2, "aux_loss_weight": 0.05})
    meetings = Meetings()
    strategy = HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, fault_tolerance=ft)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
                         callbacks=[meetings], use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=FixedOrderData(text_dataset(256, 16), 4))
    outer = strategy.replica_groups.outer
    return {"snapshots": meetings.snapshots, "before": meetings.before, "meetings": outer.meetings,
            "names": outer.names, "fragment_names": outer.fragment_names()}


def expected_meeting(before: list[dict[str, Any]], ft: dict, fragment: list[int]) -> dict[int, torch.Tensor]:
    """One rank's fragment shards after a meeting, from every group's shards as the exchange started: the outer SGD
    (Nesterov) steps the last-meeting shards with the groups' mean pseudo-gradient.

    Args:
        before: per group, what :class:`Meetings` noted as the exchange started.
        ft: the ``fault_tolerance`` options.
        fragment: indices of the meeting fragment's tensors.
    """
    lr, momentum = ft.get("outer_lr", 0.7), ft.get("outer_momentum", 0.9)
    originals, state = before[0]["originals"], before[0]["outer"]["state"]
    out = {}
    for i in fragment:
        grad = sum(originals[i] - b["params"][i] for b in before) / len(before)
        buffer = state[i]["momentum_buffer"] * momentum + grad if i in state else grad
        out[i] = originals[i] - lr * (grad + momentum * buffer)
    return out


def diloco_reference(records_by_group: list[list[dict[str, Any]]], ft: dict, fragments: list[list[str]],
                     ) -> dict[int, list[dict[str, torch.Tensor]]]:
    """DiLoCo in one process: every group's model steps AdamW on its own recorded batches; ``sync_delay`` steps
    before each meeting the meeting fragment's pseudo-gradients (last-meeting parameters - parameters then) are
    averaged over the groups; at the meeting an outer SGD (Nesterov) steps the last-meeting parameters with that
    average and every group continues from them (mixed with its own by ``fragment_mix``).

    Args:
        records_by_group: each group's recorded batches, step by step.
        ft: the run's ``fault_tolerance`` options.
        fragments: the fragments' parameter names (over all ranks of a group).

    Returns:
        ``{step: every group's parameters after that step's meeting}`` (under streaming the fragments that did
        not meet are still each group's own).
    """
    models, inner = [], []
    for _ in records_by_group:
        pl.seed_everything(0, verbose=False)
        models.append(ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw"))
        inner.append(models[-1].configure_optimizers())
    originals = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    outer = torch.optim.SGD(list(originals.values()), lr=ft.get("outer_lr", 0.7),
                            momentum=ft.get("outer_momentum", 0.9), nesterov=ft.get("outer_nesterov", True))
    interval, delay = ft["sync_every"] // len(fragments), ft.get("sync_delay", 0)
    snapshots, pending = {}, {}
    for step in range(1, len(records_by_group[0]) + 1):
        for model, optimizer, records in zip(models, inner, records_by_group):
            inputs, targets = records[step - 1]["batch"]
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        if (step + delay) % interval == 0:  # the exchange starts
            meeting = fragments[((step + delay) // interval - 1) % len(fragments)]
            pending = _mean_drift(models, originals, meeting, ft.get("exchange"))
        if step % interval == 0:  # the meeting
            _outer_step(models, originals, outer, pending, ft.get("fragment_mix", 0.0))
            snapshots[step] = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]
    return snapshots


@torch.no_grad()
def _mean_drift(models: list[torch.nn.Module], originals: dict[str, torch.Tensor], names: list[str],
                exchange: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        drifts = [originals[name] - dict(m.named_parameters())[name] for m in models]
        if exchange == "bf16":  # gloo sums the bf16 buffers
            drifts = [d.to(torch.bfloat16) for d in drifts]
        out[name] = sum(drifts[1:], drifts[0]).float() / len(models)
    return out


@torch.no_grad()
def _outer_step(models: list[torch.nn.Module], originals: dict[str, torch.Tensor], outer: torch.optim.Optimizer,
                mean_drift: dict[str, torch.Tensor], mix: float) -> None:
    for name, drift in mean_drift.items():
        originals[name].grad = drift
    outer.step()
    outer.zero_grad(set_to_none=True)
    for model in models:
        for name, p in model.named_parameters():
            if name in mean_drift:
                p.lerp_(originals[name], 1 - mix) if mix else p.copy_(originals[name])
