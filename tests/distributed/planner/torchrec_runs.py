"""Real 4-rank runs of the TorchRec DLRM recipe measuring what each rank stores after its first step, and the same
plans simulated (``tests/distributed/planner/test_simulation_torchrec.py``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl

from tests.distributed.planner.simulation_runs import WORLD, stored_bytes

TABLE_SIZES = (1000, 500, 64, 32)
# name -> (TorchRecStrategy arguments, table optimizer)
TORCHREC_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "table_wise adagrad": ({"sharding": "table_wise"}, "adagrad"),
    "column_wise 8 adagrad": ({"sharding": "column_wise", "column_shard_dim": 8}, "adagrad"),
    "table_wise rowwise_adagrad": ({"sharding": "table_wise"}, "rowwise_adagrad"),
    "t_0 data_parallel, others table_wise": ({"sharding": {"t_0": "data_parallel", "t_1": "table_wise",
                                                           "t_2": "table_wise", "t_3": "table_wise"}}, "adagrad"),
}


def model(optimizer: str) -> Any:
    """Builds the TorchRec DLRM of these runs (4 tables, 16 wide; Adam on the dense part)."""
    from examples.recsys.torchrec_model import TorchRecDLRM

    return partial(TorchRecDLRM, table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer=optimizer,
                   table_lr=0.05)


def _local_parameters(strategy: Any) -> list[Any]:
    return [p.local_tensor() if hasattr(p, "local_tensor") else p for p in strategy.dmp.parameters()]


class HeldAfterFirstStep(pl.Callback):
    """Parameter, gradient and optimizer bytes as stored in the first step: the model's parameters (local shards;
    a zero-size placeholder where a table is elsewhere) and the optimizers' state after it -- the dense optimizer's,
    the replicated tables' twins' and the fused optimizers' (their local shards) --, and the gradients at the
    optimizer step (views of DDP's buckets, which DDP keeps: the twins drop a replicated table's view after their
    step, not the bucket)."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.gradients: int = -1

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if self.gradients < 0:
            params = _local_parameters(trainer.strategy)
            self.gradients = stored_bytes([p.grad for p in params if p.grad is not None])

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.held:
            return
        strategy = trainer.strategy
        params = _local_parameters(strategy)
        twins = strategy.replicated_tables.optimizers.values() if strategy.replicated_tables else []
        dense = [o for o in trainer.optimizers] + [optimizer for _, optimizer in twins]
        state = [v for o in dense for s in o.state.values() for v in s.values() if hasattr(v, "shape")]
        fused = [shard.tensor for value in strategy.dmp.fused_optimizer.state_dict()["state"].values()
                 for tensor in value.values() for shard in tensor.local_shards()]
        self.held = {"parameter_bytes": stored_bytes([p for p in params if p.numel()]),
                     "gradient_bytes": self.gradients,
                     "optimizer_bytes": stored_bytes(state) + sum(t.numel() * t.element_size() for t in fused)}


def measure_torchrec(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, int]]:
    """Fit one step of every named case; per case, this rank's bytes after it."""
    from examples.recsys.torchrec_data import ZipfClickDataModule
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy
    from lightning_parallel.testing.fit import quiet_trainer

    out = {}
    for name in names:
        arguments, optimizer = TORCHREC_CASES[name]
        pl.seed_everything(0)
        recorder = HeldAfterFirstStep()
        trainer = quiet_trainer(world_size, TorchRecStrategy(**arguments), 1, [recorder], limit_val_batches=0)
        data = ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=64, val_samples=64, batch_size=8,
                                   shuffle=False)
        trainer.fit(model(optimizer)(), datamodule=data)
        out[name] = recorder.held
    return out


def simulated_torchrec(name: str) -> Any:
    """The simulation of case ``name`` on :data:`WORLD` ranks (this machine's cluster: CPU, gloo)."""
    from lightning_parallel.cli.simulate_strategies import simulate_torchrec
    from lightning_parallel.planner.cluster import load_cluster
    from lightning_parallel.runtime.config_dir import CONFIG_DIR
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

    arguments, optimizer = TORCHREC_CASES[name]
    return simulate_torchrec(model(optimizer), TorchRecStrategy(**arguments), WORLD, load_cluster("cpu", CONFIG_DIR))
