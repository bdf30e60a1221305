"""The parallel layout: how a world of ranks splits into data, pipeline and tensor groups.

This is the only module that knows how a global rank maps to (data, pipeline, tensor)
coordinates. Everything else asks it, so a change of placement happens in one place.

Note:
    Ranks are placed tensor-innermost, then pipeline, then data (row-major over the mesh
    shape ``(data, pipeline, tensor)``). Tensor innermost is what Megatron-LM (order
    ``tp-cp-ep-dp-pp``) and torchtitan (mesh ``pp, dp_replicate, dp_shard, cp, tp``) do: the
    tensor group, which talks on every layer, is a run of contiguous ranks (one node's
    NVLink island on a GPU cluster). Both put the *pipeline* outermost; here the data axis
    is, so that one pipeline's stages sit next to each other (one node at small scale) and
    the data-parallel group, which talks once per step, spans the widest distance. The
    axis names ``data_parallel``/``tensor_parallel`` are Lightning ModelParallelStrategy's,
    so its ``distributed_sampler_kwargs`` and ``configure_model`` idioms work unchanged.

    The data axis may itself be split ``data_replicate x data_shard`` (HSDP, torchtitan's
    ``dp_replicate x dp_shard``): data index ``replica * data_shard + shard``, so the shard
    group -- which all-gathers every layer -- is a run of neighbouring data ranks and the
    replica group, which all-reduces once per step, spans the distance. The mesh keeps the
    3-D ``data_parallel`` axis (one group for samplers, loss means, token counts); the 2-D
    ``(data_replicate, data_shard)`` view FSDP2 needs is the same ranks, unflattened.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Optional

from lightning_parallel.layout.world import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    MESH_AXES,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    Size,
    World,
    axes_after_context,
    check_size,
    context_mismatch,
    factorizations,
)

__all__ = ["CONTEXT_PARALLEL", "DATA_AXES", "DATA_CONTEXT", "DATA_PARALLEL", "DATA_REPLICATE", "DATA_SHARD",
           "DEFAULT_NAMES", "MESH_AXES", "PIPELINE_PARALLEL", "TENSOR_PARALLEL", "ParallelLayout", "RankCoordinates",
           "Size", "check_size", "factorizations", "EXPERT_DATA",
           "EXPERT_PARALLEL"]

DATA_REPLICATE = "data_replicate"
DATA_SHARD = "data_shard"
DATA_AXES: tuple[str, str] = (DATA_REPLICATE, DATA_SHARD)
# Context parallelism splits each sequence over the ranks of a data replica. Its axis sits between data and
# pipeline (torchtitan's ``dp, cp, pp?, tp`` order, Megatron's ``tp-cp-..-dp``): a context group talks on every
# attention layer, less than a tensor group and more than a data group. The root mesh then has a flat
# ``data_context`` axis (FSDP2 shards and reduces gradients over it: context ranks hold the same parameters);
# the run's mesh is its 4-D view ``(data_parallel, context_parallel, pipeline_parallel, tensor_parallel)``.
DATA_CONTEXT = "data_context"
# Expert parallelism borrows data x context ranks (torchtitan's ``dp_shard x cp == efsdp x ep``): the ranks of
# one (pipeline, tensor) position, which hold different tokens, split into expert groups of consecutive ranks
# (each holding E / ep experts) and expert-data groups across them (holding the same experts).
EXPERT_PARALLEL = "expert_parallel"
EXPERT_DATA = "expert_data"


# How messages spell each setting by default (the Python API's words); the entry point passes
# the Hydra paths the user typed (``strategy.pipeline_parallel_size``, ``trainer.devices``).
DEFAULT_NAMES: dict[str, str] = {
    DATA_PARALLEL: DATA_PARALLEL,
    PIPELINE_PARALLEL: PIPELINE_PARALLEL,
    TENSOR_PARALLEL: TENSOR_PARALLEL,
    CONTEXT_PARALLEL: CONTEXT_PARALLEL,
    "devices": "devices",
    "num_nodes": "num_nodes",
}


class RankCoordinates(NamedTuple):
    """Position of one rank on the three mesh axes (its context position: :meth:`ParallelLayout.context_rank`)."""

    data: int
    pipeline: int
    tensor: int


@dataclass(frozen=True)
class ParallelLayout:
    """A validated data x pipeline x tensor split of ``world_size`` ranks.

    Build it with :meth:`resolve`, which accepts ``"auto"`` for one axis and checks
    everything before any process group exists, so a bad layout fails fast with a
    message that says what to change.

    Args:
        world_size: number of processes (``devices * num_nodes``).
        data_parallel: replicas of the model; only this axis multiplies the global batch.
        pipeline_parallel: pipeline stages (groups of consecutive layers).
        tensor_parallel: ranks that split each layer's weights.
        data_replicate: groups the data axis splits into for HSDP (ZeRO 2/3 shard within a
            group of ``data_shard = data_parallel / data_replicate`` ranks and all-reduce across
            groups); 1 (default): one group, ZeRO 2/3 shard over the whole data axis.
        context_parallel: ranks that split each sequence of a data replica (context parallelism; never
            ``"auto"``); 1: off. They hold the same parameters, so gradients reduce over data x context.
        expert_parallel: ranks among the data x context ranks that share a mixture-of-experts layer's experts,
            each holding ``E / expert_parallel`` of them (must divide data x context); 1: off.
    """

    world_size: int
    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int
    data_replicate: int = 1
    context_parallel: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "data_parallel", "pipeline_parallel", "tensor_parallel", "context_parallel",
                     "expert_parallel"):
            value = getattr(self, name)
            if value == "auto":
                raise ValueError(
                    f"{name}='auto' must be resolved first: build the layout with ParallelLayout.resolve()."
                )
            check_size(name, value)
        sizes = {DATA_PARALLEL: self.data_parallel, PIPELINE_PARALLEL: self.pipeline_parallel,
                 TENSOR_PARALLEL: self.tensor_parallel}
        if math.prod(sizes.values()) * self.context_parallel != self.world_size:
            if self.world_size % self.context_parallel:
                raise ValueError(context_mismatch(self.world_size, self.context_parallel, World(
                    self.world_size, 1, DEFAULT_NAMES)))
            raise ValueError(World(self.world_size // self.context_parallel, 1, DEFAULT_NAMES).mismatch(sizes))
        if self.data_context % self.expert_parallel:
            divisors = [d for d in range(1, self.data_context + 1) if self.data_context % d == 0]
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel} must divide the ranks holding different tokens, data x "
                f"context = {self.data_parallel} x {self.context_parallel} = {self.data_context} (experts borrow "
                f"them). Fix: expert_parallel_size among {divisors}, or more data-parallel ranks.")
        check_size("data_replicate", self.data_replicate)
        if self.data_parallel % self.data_replicate:
            raise ValueError(
                f"data_replicate={self.data_replicate} does not divide data_parallel={self.data_parallel}: the data "
                f"axis splits into replica groups of equal size. Fix: a divisor of {self.data_parallel}."
            )

    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel: Size = "auto",
        pipeline_parallel: Size = 1,
        tensor_parallel: Size = 1,
        names: Optional[Mapping[str, str]] = None,
        num_nodes: int = 1,
        data_replicate: Optional[int] = None,
        data_shard: Optional[int] = None,
        context_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelLayout:
        """Fill in at most one ``"auto"`` size from the world size and validate.

        Args:
            world_size: number of processes.
            data_parallel, pipeline_parallel, tensor_parallel: sizes, one of them may be ``"auto"``.
            names: how the caller spells each setting in messages (keys of :data:`DEFAULT_NAMES`,
                e.g. ``{"pipeline_parallel": "strategy.pipeline_parallel_size", "devices": "trainer.devices"}``).
            num_nodes: nodes in the world (only for the messages' device counts).
            data_replicate, data_shard: the HSDP split of the data axis (either, or both with product
                ``data_parallel``); None for both: one shard group (``data_replicate=1``).
            context_parallel, expert_parallel: ranks splitting each sequence (explicit; the other axes share the
                rest); ranks sharing each MoE layer's experts (borrowed from data x context).

        Raises:
            ValueError: non-positive sizes, more than one ``"auto"``, sizes that do not multiply (or divide) to
                the world size, or an HSDP split that does not divide the data axis; naming the fix.
        """
        if world_size == "auto":
            raise ValueError("world_size cannot be 'auto': pass devices x num_nodes.")
        check_size("world_size", world_size)
        full_world = World(world_size, num_nodes, {**DEFAULT_NAMES, **(names or {})})
        world = _after_context(full_world, context_parallel)  # the other axes share what context leaves
        sizes = {DATA_PARALLEL: data_parallel, PIPELINE_PARALLEL: pipeline_parallel, TENSOR_PARALLEL: tensor_parallel}
        for axis, value in sizes.items():
            check_size(world.names[axis], value)
        auto = [axis for axis, value in sizes.items() if value == "auto"]
        if len(auto) > 1:
            raise ValueError(world.too_many_autos(sizes, auto))
        fixed = math.prod(v for v in sizes.values() if v != "auto")
        if (world.size % fixed) if auto else (fixed != world.size):
            raise ValueError(axes_after_context(sizes, context_parallel, world, full_world) if world is not full_world
                             else world.mismatch(sizes))
        if auto:
            sizes[auto[0]] = world.size // fixed
        replicas = _replica_groups(sizes[DATA_PARALLEL], data_replicate, data_shard, world.names)
        return cls(full_world.size, sizes[DATA_PARALLEL], sizes[PIPELINE_PARALLEL],
                   sizes[TENSOR_PARALLEL], replicas, context_parallel, expert_parallel)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in axis order ``(data, pipeline, tensor)``."""
        return (self.data_parallel, self.pipeline_parallel, self.tensor_parallel)

    @property
    def data_shard(self) -> int:
        """Ranks of one HSDP shard group (the whole data axis unless ``data_replicate > 1``)."""
        return self.data_parallel // self.data_replicate

    @property
    def data_parallel_enabled(self) -> bool:
        return self.data_parallel > 1

    @property
    def hsdp_enabled(self) -> bool:
        """Whether the data axis is split into several replica groups of several shards each."""
        return 1 < self.data_replicate < self.data_parallel

    @property
    def context_parallel_enabled(self) -> bool:
        return self.context_parallel > 1

    @property
    def data_context(self) -> int:
        """Ranks holding the same parameters on one (pipeline, tensor) position: data x context."""
        return self.data_parallel * self.context_parallel

    @property
    def expert_data(self) -> int:
        """Ranks holding the same experts (the expert-data group): data x context over the expert size."""
        return self.data_context // self.expert_parallel

    @property
    def pipeline_parallel_enabled(self) -> bool:
        return self.pipeline_parallel > 1

    @property
    def tensor_parallel_enabled(self) -> bool:
        return self.tensor_parallel > 1

    def coordinates(self, rank: int) -> RankCoordinates:
        """The (data, pipeline, tensor) position of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}.")
        tensor = rank % self.tensor_parallel
        pipeline = (rank // self.tensor_parallel) % self.pipeline_parallel
        data = rank // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)
        return RankCoordinates(data, pipeline, tensor)

    def context_rank(self, rank: int) -> int:
        """Global ``rank``'s position in its context group (0 without context parallelism)."""
        return (rank // (self.tensor_parallel * self.pipeline_parallel)) % self.context_parallel

    def data_coordinates(self, rank: int) -> tuple[int, int]:
        """The (replica group, shard) position of global ``rank`` on the split data axis."""
        data = self.coordinates(rank).data
        return divmod(data, self.data_shard)

    def rank_at(self, data: int, pipeline: int, tensor: int, context: int = 0) -> int:
        """The global rank at mesh position (data, pipeline, tensor, context)."""
        data_context = data * self.context_parallel + context
        return (data_context * self.pipeline_parallel + pipeline) * self.tensor_parallel + tensor

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share ``rank``'s coordinates on every axis but ``axis``."""
        (d, p, t), c = self.coordinates(rank), self.context_rank(rank)
        if axis == DATA_PARALLEL:
            return [self.rank_at(i, p, t, c) for i in range(self.data_parallel)]
        if axis == PIPELINE_PARALLEL:
            return [self.rank_at(d, i, t, c) for i in range(self.pipeline_parallel)]
        if axis == TENSOR_PARALLEL:
            return [self.rank_at(d, p, i, c) for i in range(self.tensor_parallel)]
        if axis == CONTEXT_PARALLEL:
            return [self.rank_at(d, p, t, i) for i in range(self.context_parallel)]
        if axis in (DATA_CONTEXT, EXPERT_PARALLEL, EXPERT_DATA):
            return self._data_context_group(axis, rank)
        if axis in DATA_AXES:
            replica, shard = self.data_coordinates(rank)
            data = ([r * self.data_shard + shard for r in range(self.data_replicate)] if axis == DATA_REPLICATE
                    else [replica * self.data_shard + s for s in range(self.data_shard)])
            return [self.rank_at(i, p, t, c) for i in data]
        known = MESH_AXES + (CONTEXT_PARALLEL, DATA_CONTEXT, EXPERT_PARALLEL, EXPERT_DATA) + DATA_AXES
        raise ValueError(f"Unknown mesh axis {axis!r}: use one of {known}.")

    def _data_context_group(self, axis: str, rank: int) -> list[int]:
        """The data x context ranks of ``rank``'s (pipeline, tensor) position, or its expert or expert-data part."""
        (d, p, t), c = self.coordinates(rank), self.context_rank(rank)
        ranks = [self.rank_at(i, p, t, j) for i in range(self.data_parallel) for j in range(self.context_parallel)]
        if axis == DATA_CONTEXT:
            return ranks
        block, index = divmod(d * self.context_parallel + c, self.expert_parallel)
        if axis == EXPERT_PARALLEL:  # consecutive ranks of data x context
            return ranks[block * self.expert_parallel:(block + 1) * self.expert_parallel]
        return ranks[index::self.expert_parallel]

    def rank_map(self) -> list[tuple[int, RankCoordinates]]:
        """Every global rank with its coordinates, for the start-up table."""
        return [(rank, self.coordinates(rank)) for rank in range(self.world_size)]

    def describe(self) -> str:
        """Short form such as ``dp2 x pp2 x tp1``, or ``dp4(2x2) x pp1 x tp1`` under HSDP."""
        data = f"dp{self.data_parallel}" + (f"({self.data_replicate}x{self.data_shard})" if self.hsdp_enabled else "")
        context = f" x cp{self.context_parallel}" if self.context_parallel_enabled else ""
        experts = f" (ep{self.expert_parallel})" if self.expert_parallel > 1 else ""
        return f"{data}{context} x pp{self.pipeline_parallel} x tp{self.tensor_parallel}{experts}"


def _after_context(world: World, context_parallel: Size) -> World:
    """The world the data, pipeline and tensor axes share once ``context_parallel`` ranks split each sequence."""
    check_size(world.names[CONTEXT_PARALLEL], context_parallel)
    if context_parallel == "auto" or world.size % context_parallel:
        raise ValueError(context_mismatch(world.size, context_parallel, world))
    return world if context_parallel == 1 else World(world.size // context_parallel, world.num_nodes, world.names)


def _replica_groups(
    data_parallel: int, replicate: Optional[int], shard: Optional[int], names: Mapping[str, str]
) -> int:
    """``data_replicate`` from the requested HSDP split of a resolved data axis (1 when none is asked)."""
    rep_name, shard_name = names.get(DATA_REPLICATE, DATA_REPLICATE), names.get(DATA_SHARD, DATA_SHARD)
    for name, value in ((rep_name, replicate), (shard_name, shard)):
        if value is not None:
            check_size(name, value)
            if value == "auto" or data_parallel % value:
                raise ValueError(
                    f"{name}={value!r} does not divide the data axis {names[DATA_PARALLEL]}={data_parallel}. Fix: "
                    f"{rep_name} x {shard_name} = {data_parallel} (a divisor of {data_parallel} for either)."
                )
    if replicate is not None and shard is not None and replicate * shard != data_parallel:
        raise ValueError(
            f"{rep_name}={replicate} x {shard_name}={shard} = {replicate * shard}, but the data axis is "
            f"{names[DATA_PARALLEL]}={data_parallel}. Fix: sizes whose product is {data_parallel}, or give only one."
        )
    if replicate is not None:
        return replicate
    return data_parallel // shard if shard is not None else 1
