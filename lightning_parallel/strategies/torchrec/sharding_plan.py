"""Sharding plans for :class:`~lightning_parallel.strategies.torchrec.strategy.TorchRecStrategy`: which types can run,
the planner's constraints from ``sharding=``, and the plan as a table (table, type, ranks, bytes per rank).

A plan is data (TorchRec's ``ShardingPlan``: table -> sharding type, ranks, shard offsets and sizes). Everything
here is arithmetic over it and needs no process group, except :func:`plan_sharding` with a group, where the
planner agrees on one plan across ranks (``collective_plan``).

Note:
    What runs where is TorchRec's answer, asked of its sharder (``sharding_types(device_type)``): on CPU that is
    data-parallel, table-wise, column-wise and table-column-wise. Row-wise variants are further refused on gloo
    whatever the device: their backward uses an asynchronous ``reduce_scatter_base`` gloo lacks (TorchRec skips
    its own row-wise tests on gloo for that reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch import nn

from lightning_parallel.adapters.torchrec import table_bytes

#: Every sharding type TorchRec names (``torchrec.distributed.types.ShardingType`` values).
SHARDING_TYPES = ("data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise",
                  "grid_shard")
#: Types whose backward needs an asynchronous reduce-scatter, which gloo does not have.
_NEEDS_REDUCE_SCATTER = ("row_wise", "table_row_wise", "grid_shard")

Sharding = Union[None, str, Mapping[str, str]]


def runnable_sharding_types(device_type: str, backend: str) -> list[str]:
    """The sharding types TorchRec runs for an ``EmbeddingBagCollection`` on ``device_type`` over ``backend``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        backend: the process group's backend (``"gloo"``, ``"nccl"``).
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    types = EmbeddingBagCollectionSharder().sharding_types(device_type)
    return [t for t in types if not (backend == "gloo" and t in _NEEDS_REDUCE_SCATTER)]


def check_sharding_names(sharding: Sharding) -> None:
    """Refuse ``sharding=`` values that are not TorchRec sharding types (no TorchRec needed).

    Raises:
        ValueError: an unknown type, or not a str / mapping of table name to str.
    """
    if sharding is None:
        return
    if isinstance(sharding, str):
        values = [sharding]
    elif isinstance(sharding, Mapping):
        values = list(sharding.values())
    else:
        raise ValueError(f"sharding={sharding!r} must be None, a sharding type, or {{table name: sharding type}}.")
    unknown = [v for v in values if v not in SHARDING_TYPES]
    if unknown:
        raise ValueError(f"sharding types {unknown} are not TorchRec's: use one of {list(SHARDING_TYPES)}.")


def check_runnable(sharding: Sharding, device_type: str, backend: str) -> None:
    """Refuse a sharding type this device and backend cannot run, naming the ones that work.

    Raises:
        ValueError: a requested type is not runnable here.
    """
    check_sharding_names(sharding)
    if sharding is None:
        return
    wanted = {"every table": sharding} if isinstance(sharding, str) else dict(sharding)
    runnable = runnable_sharding_types(device_type, backend)
    bad = {table: kind for table, kind in wanted.items() if kind not in runnable}
    if bad:
        why = (" (row-wise types need an asynchronous reduce-scatter that gloo lacks)"
               if backend == "gloo" and any(k in _NEEDS_REDUCE_SCATTER for k in bad.values()) else "")
        raise ValueError(
            f"TorchRec cannot shard {bad} on {device_type} with {backend}{why}. Sharding types that run here: "
            f"{runnable}."
        )


def parameter_constraints(
    tables: Mapping[str, tuple[str, Any]],
    sharding: Sharding,
    runnable: list[str],
    compute_kernel: str = "fused",
    column_shard_dim: Optional[int] = None,
) -> dict[str, Any]:
    """The planner's ``ParameterConstraints`` per table: the requested type (or any runnable one), its kernel.

    Args:
        tables: ``{table name: (collection path, EmbeddingBagConfig)}``.
        sharding: None (the planner chooses among ``runnable``), one type for every table, or
            ``{table: type}`` (tables left out: the planner chooses).
        runnable: the types this device and backend can run.
        compute_kernel: the kernel of sharded tables; data-parallel tables always use ``"dense"``.
        column_shard_dim: width of column-wise shards (``min_partition``); None: TorchRec's default (128 or
            the whole width), which leaves a narrow table in one shard.

    Raises:
        ValueError: ``sharding`` names a table the model does not have.
    """
    from torchrec.distributed.planner.types import ParameterConstraints

    wanted = dict.fromkeys(tables, sharding) if isinstance(sharding, str) or sharding is None else dict(sharding)
    unknown = sorted(set(wanted) - set(tables))
    if unknown:
        raise ValueError(f"sharding names tables {unknown} the model does not have; its tables: {sorted(tables)}.")
    constraints = {}
    for table in tables:
        # A table the caller left to the planner is sharded, never replicated: a replicated (data-parallel) table
        # has the dense kernel and is updated by the dense optimizer, a sharded one by its fused optimizer.
        types = [wanted[table]] if wanted.get(table) else [t for t in runnable if t != "data_parallel"]
        kernels = ["dense"] if types == ["data_parallel"] else [compute_kernel]
        constraints[table] = ParameterConstraints(sharding_types=types, compute_kernels=kernels,
                                                  min_partition=column_shard_dim)
    return constraints


def plan_sharding(module: nn.Module, sharders: list, constraints: dict[str, Any], world_size: int,
                  device_type: str, process_group: Any = None) -> Any:
    """TorchRec's planner over ``module``'s collections; with ``process_group``, one plan agreed by all ranks.

    Args:
        module: the (unsharded, possibly ``meta``) model.
        sharders: TorchRec sharders (an ``EmbeddingBagCollectionSharder``).
        constraints: from :func:`parameter_constraints`.
        world_size: ranks to shard over.
        device_type: ``"cpu"`` or ``"cuda"``.
        process_group: the group to plan collectively over; None plans here alone (rank 0's view; tests, tools).

    Returns:
        A ``torchrec.distributed.types.ShardingPlan``.
    """
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, constraints=constraints, debug=False,
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
    )
    if process_group is not None:
        return planner.collective_plan(module, sharders, process_group)
    return planner.plan(module, sharders)


def plan_tables(module: nn.Module, tables: Mapping[str, tuple[str, Any]], sharding: Sharding, world_size: int,
                device_type: str, backend: str, compute_kernel: str = "fused", column_shard_dim: Optional[int] = None,
                process_group: Any = None) -> Any:
    """The strategy's plan for ``module``: constraints from ``sharding=`` over the types this device and backend
    run, then :func:`plan_sharding` (the strategy's set-up, and ``lp-simulate`` without a process group).

    Args:
        module: the (unsharded, possibly ``meta``) model, its tables given their optimizers.
        tables: its :func:`~lightning_parallel.adapters.torchrec.table_configs`.
        sharding: the strategy's ``sharding=``.
        world_size: ranks to shard over.
        device_type: ``"cpu"`` or ``"cuda"``.
        backend: the process group's backend (which types run).
        compute_kernel: the kernel of sharded tables.
        column_shard_dim: the width of column-wise shards (None: TorchRec's).
        process_group: plan collectively over it; None: here alone.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    runnable = runnable_sharding_types(device_type, backend)
    constraints = parameter_constraints(tables, sharding, runnable, compute_kernel, column_shard_dim)
    return plan_sharding(module, [EmbeddingBagCollectionSharder()], constraints, world_size, device_type,
                         process_group)


def table_shards(plan: Any, tables: Mapping[str, tuple[str, Any]],
                 settings: Mapping[str, tuple[type, dict[str, Any]]], world_size: int) -> list[Any]:
    """Every rank's pieces of every table under ``plan``, for ``lp-simulate``
    (:class:`~lightning_parallel.planner.simulation.tables.TableShard`: offsets, sizes, dtype, fused optimizer).

    Args:
        plan: a TorchRec ``ShardingPlan``.
        tables: ``{table name: (collection path, EmbeddingBagConfig)}``.
        settings: ``{table: (optimizer class, kwargs)}`` the tables were given (``table_optimizers``).
        world_size: ranks of the run.
    """
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

    from lightning_parallel.planner.simulation.tables import TableShard

    shards = []
    for table, (path, config) in tables.items():
        sharding = plan.plan[path][table]
        rows, cols = int(config.num_embeddings), int(config.embedding_dim)
        itemsize = table_bytes(config) // max(1, rows * cols)
        if sharding.sharding_type == "data_parallel":
            shards += [TableShard(table, "data_parallel", r, 0, 0, rows, cols, itemsize) for r in range(world_size)]
            continue
        fused = optimizer_type_to_emb_opt_type(settings[table][0]).name if table in settings else "EXACT_SGD"
        for shard in sharding.sharding_spec.shards:
            (row, col), (height, width) = shard.shard_offsets, shard.shard_sizes
            shards.append(TableShard(table, sharding.sharding_type, shard.placement.rank(), int(row), int(col),
                                     int(height), int(width), itemsize, fused))
    return shards


@dataclass(frozen=True)
class PlanRow:
    """One table of a plan.

    Attributes:
        table: the table's name.
        collection: the path of its ``EmbeddingBagCollection``.
        sharding_type: TorchRec's sharding type.
        ranks: the ranks holding a piece of it, in order.
        bytes_per_rank: the table's weight bytes on each rank (0 where it holds none).
    """

    table: str
    collection: str
    sharding_type: str
    ranks: tuple[int, ...]
    bytes_per_rank: tuple[int, ...]


def plan_rows(plan: Any, tables: Mapping[str, tuple[str, Any]], world_size: int) -> list[PlanRow]:
    """The plan as one :class:`PlanRow` per table.

    Args:
        plan: a TorchRec ``ShardingPlan``.
        tables: ``{table name: (collection path, EmbeddingBagConfig)}``.
        world_size: ranks of the run.
    """
    rows = []
    for table, (path, config) in tables.items():
        sharding = plan.plan[path][table]
        per_rank = [0] * world_size
        if sharding.sharding_type == "data_parallel":
            per_rank = [table_bytes(config)] * world_size
        else:
            element = table_bytes(config) // max(1, int(config.num_embeddings) * int(config.embedding_dim))
            for shard in sharding.sharding_spec.shards:
                rows_, cols = shard.shard_sizes
                per_rank[shard.placement.rank()] += int(rows_) * int(cols) * element
        ranks = tuple(r for r in range(world_size) if per_rank[r])
        rows.append(PlanRow(table, path, sharding.sharding_type, ranks, tuple(per_rank)))
    return rows


def bytes_per_rank(rows: list[PlanRow]) -> list[int]:
    """Table weight bytes each rank holds under the plan (summed over tables)."""
    return [sum(column) for column in zip(*(r.bytes_per_rank for r in rows))] if rows else []


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def format_plan(rows: list[PlanRow]) -> str:
    """The plan as a text table: table, type, ranks, MiB per rank, and a total line."""
    world = len(rows[0].bytes_per_rank) if rows else 0
    header = ["table", "sharding type", "ranks", *[f"rank {r} MiB" for r in range(world)]]
    body = [[r.table, r.sharding_type, ",".join(map(str, r.ranks)), *map(_mib, r.bytes_per_rank)] for r in rows]
    body.append(["total", "", "", *map(_mib, bytes_per_rank(rows))])
    widths = [max(len(str(line[i])) for line in [header, *body]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
