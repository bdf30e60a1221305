"""``lp-simulate`` for the strategies that are not the hybrid one: TorchRec (its planner's plan) and DeepSpeed ZeRO.

The hybrid strategy and its presets are simulated by running their composition in a fake world
(:func:`lightning_parallel.planner.simulation.simulate`). TorchRec's and DeepSpeed's set-ups are the libraries' own,
so each is simulated from the library's own answer for the world: TorchRec's planner makes the plan a run would make
(:mod:`lightning_parallel.planner.simulation.tables`), DeepSpeed's partition arithmetic gives every rank's flat
partitions (:mod:`lightning_parallel.planner.simulation.zero_partitions`). The run's checks come first: what the
strategy refuses at set-up is refused here with its message.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Optional

from torch import nn


def cluster_device(cluster: Any) -> tuple[str, str]:
    """``(device type, backend)`` of a cluster: this CPU machine's (``compute: measured``) or a GPU cluster's."""
    return ("cpu", "gloo") if getattr(cluster, "compute", "peak") == "measured" else ("cuda", "nccl")


def simulate_torchrec(build: Any, strategy: Any, world_size: int, cluster: Any,
                      device_memory: Optional[float] = None) -> Any:
    """Every rank's bytes under the plan TorchRec's planner makes for ``world_size`` ranks.

    Args:
        build: builds the LightningModule (``configure_model`` is run on ``meta`` here).
        strategy: the run's :class:`~lightning_parallel.strategies.TorchRecStrategy`.
        world_size: ranks in the world.
        cluster: the cluster (its device type decides the sharding types that run and the planner's topology).
        device_memory: bytes per device to predict the fit against.

    Raises:
        ValueError: what the strategy refuses (a sharding type the device or backend cannot run, a replicated table
            whose optimizer has no dense twin, a model without TorchRec tables).
    """
    from lightning_parallel.adapters.torchrec import embedding_collections, require_torchrec, table_optimizers
    from lightning_parallel.planner.simulation.tables import simulate_tables
    from lightning_parallel.strategies.torchrec.replicated import dense_twin
    from lightning_parallel.strategies.torchrec.sharding_plan import check_runnable, plan_tables, table_shards

    started = time.perf_counter()
    require_torchrec()
    device, backend = cluster_device(cluster)
    check_runnable(strategy.sharding, device, backend)
    module, tables = _module_with_tables(build, strategy)
    settings = table_optimizers(module, tables)
    plan = plan_tables(module, tables, strategy.sharding, world_size, device, backend, strategy.compute_kernel,
                       strategy.column_shard_dim)
    shards = table_shards(plan, tables, settings, world_size)
    replicated = sorted({s.table for s in shards if s.sharding_type == "data_parallel" and s.table in settings})
    twins = {table: partial(_twin, *dense_twin(table, *settings[table])) for table in replicated}
    shapes = {table: (int(config.num_embeddings), int(config.embedding_dim)) for table, (_, config) in tables.items()}
    weights = {id(p) for collection in embedding_collections(module).values() for p in collection.parameters()}
    simulation = simulate_tables(module, shards, shapes, world_size, table_parameters=weights, twins=twins,
                                 device_memory=device_memory,
                                 settings={"strategy": "torchrec", "device": device, "backend": backend,
                                           "sharding": str(strategy.sharding)})
    simulation.seconds = time.perf_counter() - started  # the planner's time included
    return simulation


def simulate_deepspeed(build: Any, strategy: Any, world_size: int, precision: str,
                       device_memory: Optional[float] = None) -> Any:
    """Every rank's bytes under the strategy's ZeRO stage, by DeepSpeed's partition arithmetic
    (:mod:`lightning_parallel.planner.simulation.zero_partitions`).

    Args:
        build: builds the LightningModule (``configure_model`` is run on ``meta`` here).
        strategy: the run's :class:`~lightning_parallel.strategies.DeepSpeedDataParallelStrategy`.
        world_size: ranks in the world (all data-parallel under DeepSpeed).
        precision: the Trainer's precision name.
        device_memory: bytes per device to predict the fit against.

    Raises:
        ValueError: offloading (host memory is not simulated), or a precision the arithmetic does not cover.
    """
    from lightning_parallel.planner.simulation.rank_run import build_on_meta
    from lightning_parallel.planner.simulation.zero_partitions import ZeroSettings, simulate_zero

    zero = dict(strategy.config.get("zero_optimization", {}))
    offloaded = [key for key in ("offload_optimizer", "offload_param")
                 if str((zero.get(key) or {}).get("device", "none")) not in ("none", "None")]
    if offloaded:
        raise ValueError(f"lp-simulate does not simulate DeepSpeed's offloading ({', '.join(offloaded)}: host "
                         "memory); simulate the same zero_stage without offload_* to see what the device holds.")
    return simulate_zero(build_on_meta(build), world_size, ZeroSettings.of(zero), precision=precision,
                         device_memory=device_memory)


def _module_with_tables(build: Any, strategy: Any) -> tuple[nn.Module, dict[str, tuple[str, Any]]]:
    """The module built on ``meta``, its tables given the strategy's optimizer where the model gave none, and its
    tables' configs (the strategy's set-up, before sharding)."""
    from lightning_parallel.adapters.torchrec import apply_table_optimizer, embedding_collections, table_configs
    from lightning_parallel.planner.simulation.rank_run import build_on_meta

    module = build_on_meta(build)
    if not embedding_collections(module):
        raise ValueError(f"{type(module).__name__} holds no torchrec EmbeddingBagCollection: strategy=torchrec "
                         "shards those (see examples/recsys/torchrec_model.py); for other models use ddp or hybrid.")
    apply_table_optimizer(module, strategy.embedding_optimizer, strategy.embedding_optimizer_kwargs)
    return module, table_configs(module)


def _twin(optimizer_class: type, kwargs: dict, parameters: list[nn.Parameter]) -> Any:
    return optimizer_class(parameters, **kwargs)
