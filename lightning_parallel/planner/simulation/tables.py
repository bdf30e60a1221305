"""A TorchRec world simulated from its sharding plan: what each rank holds of the embedding tables and the dense part.

TorchRec's strategy shards every table of an ``EmbeddingBagCollection`` by the plan its planner makes
(``strategies/torchrec/sharding_plan.py``), updates sharded tables inside backward with an optimizer fused into
fbgemm's kernels, and replicates the rest of the module under DDP. A rank therefore holds, as stored:

- parameters: its shards of the tables (rows x columns of each, in the table's dtype), the whole of every table the
  plan replicates (``data_parallel``), and the dense parameters;
- gradients: the dense parameters' and the replicated tables' (views of DDP's buckets, which hold exactly them);
  a sharded table keeps none (its fused kernel updates it in backward);
- optimizer state: the fused optimizer's per shard -- Adagrad one fp32 sum per element, row-wise Adagrad one per row,
  Adam two per element, partial row-wise Adam one per element and one per row, SGD none --, the dense twin's of every
  replicated table, and ``configure_optimizers``'s over the dense parameters, measured after one step on ``meta``.

The plan itself is TorchRec's answer for the world (its planner runs in one process, on the topology of
``world_size`` ranks: the plan ``collective_plan`` would have every rank agree on), so which rank holds which shard
is TorchRec's, and ranks that hold the same shard shapes form one class. The whole-world check: every element of
every sharded table is held by exactly one shard, of every replicated table once per rank.

Note:
    No step runs: TorchRec's sharded collections take ``KeyedJaggedTensor`` inputs and run fbgemm kernels with no
    ``meta`` implementation, so activations and the step's collectives are not simulated (the classes say so).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.planner.simulation import held
from lightning_parallel.planner.simulation.result import ClassResult, Simulation
from lightning_parallel.planner.simulation.whole_world import WholeWorldError

#: fbgemm's fused optimizer (``EmbOptimType`` name) -> fp32 state ``(per element, per row)`` of a shard.
FUSED_STATE = {"EXACT_SGD": (0, 0), "SGD": (0, 0), "EXACT_ADAGRAD": (1, 0), "EXACT_ROWWISE_ADAGRAD": (0, 1),
               "ROWWISE_ADAGRAD": (0, 1), "ADAM": (2, 0), "LAMB": (2, 0), "PARTIAL_ROWWISE_ADAM": (1, 1),
               "PARTIAL_ROWWISE_LAMB": (1, 1)}
NO_STEP_NOTE = ("TorchRec: bytes from its sharding plan; no step simulated (its sharded collections run fbgemm "
                "kernels on KeyedJaggedTensors, which have no meta implementation): activations and collectives not "
                "measured")


@dataclass(frozen=True)
class TableShard:
    """One rank's piece of one table under the plan.

    Attributes:
        table: the table's name.
        sharding_type: TorchRec's sharding type (``data_parallel``: the whole table on every rank).
        rank: the rank holding it.
        row_offset, col_offset: where the piece starts in the table.
        rows, cols: its size.
        itemsize: bytes per element of the table.
        fused: the fused optimizer's ``EmbOptimType`` name (sharded tables; ``""`` for replicated ones).
    """

    table: str
    sharding_type: str
    rank: int
    row_offset: int
    col_offset: int
    rows: int
    cols: int
    itemsize: int
    fused: str = ""

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


def fused_state_bytes(shard: TableShard) -> int:
    """Bytes of the fused optimizer's state for ``shard`` (fp32, :data:`FUSED_STATE`).

    Raises:
        ValueError: an optimizer whose state size is not known here (naming those that are).
    """
    if shard.fused not in FUSED_STATE:
        raise ValueError(f"table {shard.table}: lp-simulate does not know the state of fbgemm's {shard.fused} "
                         f"optimizer; it knows {sorted(FUSED_STATE)}.")
    per_element, per_row = FUSED_STATE[shard.fused]
    return 4 * (per_element * shard.rows * shard.cols + per_row * shard.rows)


def simulate_tables(module: nn.Module, shards: Sequence[TableShard], table_shapes: Mapping[str, tuple[int, int]],
                    world_size: int, *, table_parameters: set[int],
                    twins: Optional[Mapping[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]] = None,
                    device_memory: Optional[float] = None, settings: Optional[dict[str, Any]] = None) -> Simulation:
    """Every rank's bytes under a TorchRec plan (module docstring), ranks of equal shards in one class.

    Args:
        module: the model built on ``meta`` (its ``configure_model`` run), tables unsharded.
        shards: every rank's pieces of every table (replicated tables: one whole piece per rank).
        table_shapes: ``{table: (rows, columns)}``.
        world_size: ranks in the world.
        table_parameters: ``id`` of every table's weight in ``module`` (the rest is the dense part).
        twins: ``{replicated table: builds its dense twin optimizer over a parameter list}`` (the strategy's).
        device_memory: bytes per device to predict the fit against; None: no fit.
        settings: what the simulation ran with (for ``simulation.json``).

    Raises:
        WholeWorldError: a table element held by no shard or by two.
    """
    started = time.perf_counter()
    dense = [p for p in module.parameters() if id(p) not in table_parameters]
    dense_bytes = sum(p.numel() * p.element_size() for p in dense)
    optimizers = held.optimizers_of(module.configure_optimizers())
    held.first_step(module, optimizers)
    dense_optimizer = held.optimizer_bytes(optimizers)
    twin_bytes = {table: _twin_state_bytes(build, table_shapes[table]) for table, build in (twins or {}).items()}
    checked = check_tables(shards, table_shapes, world_size)
    by_rank: dict[int, list[TableShard]] = defaultdict(list)
    for shard in shards:
        by_rank[shard.rank].append(shard)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank in range(world_size):
        key = tuple(sorted((s.sharding_type, s.rows, s.cols, s.itemsize, s.fused) for s in by_rank[rank]))
        groups[key].append(rank)
    classes = [_class_of(ranks, by_rank[ranks[0]], dense_bytes, dense_optimizer, twin_bytes)
               for ranks in groups.values()]
    return Simulation(world_size, f"torchrec x{world_size}", classes, device_memory, checked,
                      time.perf_counter() - started, dict(settings or {}))


def _class_of(ranks: list[int], pieces: list[TableShard], dense_bytes: int, dense_optimizer: int,
              twin_bytes: Mapping[str, int]) -> ClassResult:
    replicated = [p for p in pieces if p.sharding_type == "data_parallel"]
    sharded = [p for p in pieces if p.sharding_type != "data_parallel"]
    parameters = dense_bytes + sum(p.nbytes for p in pieces)
    gradients = dense_bytes + sum(p.nbytes for p in replicated)
    optimizer = (dense_optimizer + sum(fused_state_bytes(p) for p in sharded)
                 + sum(twin_bytes.get(p.table, 0) for p in replicated))
    held_tables = ", ".join(f"{p.table} {p.sharding_type} {p.rows}x{p.cols}" for p in pieces) or "no table"
    why = f"same table shard shapes (rank {ranks[0]}: {held_tables}); the dense part replicated"
    return ClassResult(tuple(ranks), why, (), parameters, gradients, optimizer, 0,
                       None, parameters + gradients + optimizer, notes=(NO_STEP_NOTE,),
                       details={"table_bytes": sum(p.nbytes for p in pieces), "dense_parameter_bytes": dense_bytes})


def _twin_state_bytes(build: Callable[[list[torch.Tensor]], torch.optim.Optimizer], shape: tuple[int, int]) -> int:
    """A replicated table's twin optimizer state, measured after one step on ``meta`` (as :mod:`.held` does)."""
    weight = nn.Parameter(torch.empty(shape, device="meta"))
    optimizer = build([weight])
    weight.grad = torch.zeros_like(weight)
    optimizer.step()
    return held.optimizer_bytes([optimizer])


def check_tables(shards: Sequence[TableShard], table_shapes: Mapping[str, tuple[int, int]], world_size: int) -> int:
    """Every element of every sharded table held by exactly one shard, of every replicated table once per rank.

    Returns:
        The table elements checked (each once).

    Raises:
        WholeWorldError: naming the table and how often its elements are held.
    """
    by_table: dict[str, list[TableShard]] = defaultdict(list)
    for shard in shards:
        by_table[shard.table].append(shard)
    missing = sorted(set(table_shapes) - set(by_table))
    if missing:
        raise WholeWorldError(f"tables {missing} are held by no rank: the plan lost them.")
    for table, pieces in by_table.items():
        rows, cols = table_shapes[table]
        expected = world_size if pieces[0].sharding_type == "data_parallel" else 1
        counts = _coverage(pieces, rows, cols)
        wrong = sorted(set(counts) - {expected})
        if wrong:
            raise WholeWorldError(f"table {table} ({rows} x {cols}): elements held {wrong} times, the plan says "
                                  f"{expected}: a shard is lost or doubled.")
    return sum(rows * cols for rows, cols in table_shapes.values())


def _coverage(pieces: Sequence[TableShard], rows: int, cols: int) -> dict[int, int]:
    """``{times held: elements}`` over the grid the pieces' edges cut a ``rows x cols`` table into."""
    row_edges = sorted({0, rows, *(p.row_offset for p in pieces), *(p.row_offset + p.rows for p in pieces)})
    col_edges = sorted({0, cols, *(p.col_offset for p in pieces), *(p.col_offset + p.cols for p in pieces)})
    row_at = {edge: i for i, edge in enumerate(row_edges)}
    col_at = {edge: i for i, edge in enumerate(col_edges)}
    held_times: dict[tuple[int, int], int] = defaultdict(int)
    for p in pieces:
        for i in range(row_at[p.row_offset], row_at[p.row_offset + p.rows]):
            for j in range(col_at[p.col_offset], col_at[p.col_offset + p.cols]):
                held_times[(i, j)] += 1
    counts: dict[int, int] = defaultdict(int)
    for i in range(len(row_edges) - 1):
        for j in range(len(col_edges) - 1):
            size = (row_edges[i + 1] - row_edges[i]) * (col_edges[j + 1] - col_edges[j])
            if size:
                counts[held_times.get((i, j), 0)] += size
    return dict(counts)
