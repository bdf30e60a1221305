"""Rank functions and the one-process reference for the fault-tolerance tests."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_parallel.fault_tolerance.replica_state import module_state
from lightning_parallel.scaling import lr_factor
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing.faults import FaultInjection, HoldWhileDegraded, incarnation
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

WIDTH, DEPTH, BATCH, SAMPLES = 16, 4, 4, 512
LAYOUTS = {"pipeline 2": {"pipeline_parallel_size": 2, "microbatches": 2, "schedule": "gpipe"}, "one": {},
           "tensor 2": {"tensor_parallel_size": 2}}


class CommittedBatches(Callback):
    """Records, per committed step, the group's batch, loss and quorum size; rank 0 of a group also writes them to
    ``folder/group{g}_run{k}.pt`` as it goes, so the records of an incarnation that dies survive it."""

    def __init__(self, folder: Path) -> None:
        self.records: list[dict[str, Any]] = []
        self.folder = folder
        self._pending: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._pending = [t.detach().clone() for t in batch]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        groups = trainer.strategy.replica_groups
        if not groups.last_committed:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.records.append({"step": trainer.global_step - 1, "participants": groups.participants,
                             "batch": self._pending, "loss": float(loss.detach())})
        if trainer.global_rank == 0:
            name = f"group{os.environ['REPLICA_GROUP_ID']}_run{incarnation()}.pt"
            torch.save(self.records, self.folder / name)


def recorded(folder: Path, groups: int) -> list[list[dict[str, Any]]]:
    """Every group's committed steps, all incarnations in order."""
    out = []
    for g in range(groups):
        records: list[dict[str, Any]] = []
        for path in sorted(folder.glob(f"group{g}_run*.pt")):
            records.extend(torch.load(path, weights_only=False))
        out.append(records)
    return out


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors (DTensors gathered inside the group; a collective) of this rank's stage."""
    out = {}
    for name, tensor in module.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if tensor.device.type != "meta":
            out[name] = tensor.detach().clone()
    return out


def replica_rank(rank: int, world_size: int, layout: str, steps: int, faults: tuple, ft: dict, folder: str,
                 timeout: Any = None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    recorder = CommittedBatches(Path(folder))
    strategy = HybridParallelStrategy(**LAYOUTS[layout], fault_tolerance=ft, timeout=timeout)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
                         callbacks=[FaultInjection(*faults), HoldWhileDegraded(), recorder],
                         use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=FixedOrderData(regression_dataset(SAMPLES, WIDTH), BATCH))
    return {"local": module_state(model), "full": full_state(model), "records": recorder.records,
            "incarnation": incarnation(), "group": int(os.environ["REPLICA_GROUP_ID"]),
            "global_step": trainer.global_step, "failed_commits": strategy.replica_groups.failed_commits,
            "loop": trainer.fit_loop.state_dict(), "epoch": trainer.current_epoch}


def slow_healing_replica_rank(rank: int, world_size: int, *args: Any, heal_delay: float = 2.0,
                              **kwargs: Any) -> dict[str, Any]:
    """:func:`replica_rank` where group 1 fetches checkpoints ``heal_delay`` seconds late, as on a loaded machine.

    At step 0 torchft heals group 1's rank 0 from group 0 and group 0's rank 1 from group 1; group 0 may then
    commit while group 1's rank 0 is still to fetch: its server must keep serving until that fetch is done."""
    from torchft.checkpointing.http_transport import HTTPTransport

    receive = HTTPTransport.recv_checkpoint

    def late_receive(self: Any, *a: Any, **k: Any) -> Any:
        time.sleep(heal_delay)
        return receive(self, *a, **k)

    if os.environ["REPLICA_GROUP_ID"] == "1":
        HTTPTransport.recv_checkpoint = late_receive
    return replica_rank(rank, world_size, *args, **kwargs)


def reference_run(records_by_group: list[list[dict[str, Any]]], replicas: int, lead: int = 0,
                  ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the steps group ``lead`` committed, each on the batches of every group in that quorum and step.

    Returns the final state and the per-step loss of group ``lead``'s batch.
    """
    pl.seed_everything(0, verbose=False)
    model = ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    optimizer = model.configure_optimizers()
    planned = optimizer.param_groups[0]["lr"]
    losses = []
    for record in records_by_group[lead]:
        same = [r for group in records_by_group for r in group
                if r["step"] == record["step"] and r["participants"] == record["participants"]]
        assert len(same) == record["participants"], (record["step"], len(same), record["participants"])
        inputs = torch.cat([r["batch"][0] for r in same])
        targets = torch.cat([r["batch"][1] for r in same])
        optimizer.zero_grad()
        F.mse_loss(model(inputs), targets).backward()
        with torch.no_grad():
            losses.append(float(F.mse_loss(model(record["batch"][0]), record["batch"][1])))
        optimizer.param_groups[0]["lr"] = planned * lr_factor("linear", len(same), replicas)
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, losses



def local_sgd_reference(records_by_group: list[list[dict[str, Any]]], sync_every: int) -> dict[str, torch.Tensor]:
    """Every group's model on its own recorded batches, parameters averaged every ``sync_every`` steps."""
    models, optimizers = [], []
    for _ in records_by_group:
        pl.seed_everything(0, verbose=False)
        models.append(ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw"))
        optimizers.append(models[-1].configure_optimizers())
    for step in range(len(records_by_group[0])):
        for model, optimizer, records in zip(models, optimizers, records_by_group):
            inputs, targets = records[step]["batch"]
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = torch.stack([p for p in params]).mean(0)
                    for p in params:
                        p.copy_(mean)
    return {k: v.detach() for k, v in models[0].state_dict().items()}
