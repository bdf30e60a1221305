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
from typing import TYPE_CHECKING, Literal, NamedTuple, Optional, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL = "data_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
TENSOR_PARALLEL = "tensor_parallel"
MESH_AXES: tuple[str, str, str] = (DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL)
DATA_REPLICATE = "data_replicate"
DATA_SHARD = "data_shard"
DATA_AXES: tuple[str, str] = (DATA_REPLICATE, DATA_SHARD)

Size = Union[int, Literal["auto"]]

# How messages spell each setting by default (the Python API's words); the entry point passes
# the Hydra paths the user typed (``strategy.pipeline_parallel_size``, ``trainer.devices``).
DEFAULT_NAMES: dict[str, str] = {
    DATA_PARALLEL: DATA_PARALLEL,
    PIPELINE_PARALLEL: PIPELINE_PARALLEL,
    TENSOR_PARALLEL: TENSOR_PARALLEL,
    "devices": "devices",
    "num_nodes": "num_nodes",
}


class RankCoordinates(NamedTuple):
    """Position of one rank on the three mesh axes."""

    data: int
    pipeline: int
    tensor: int


def _factorizations(world_size: int) -> list[tuple[int, int, int]]:
    """All (data, pipeline, tensor) triples whose product is ``world_size``."""
    out = []
    for d in range(1, world_size + 1):
        if world_size % d:
            continue
        rest = world_size // d
        for p in range(1, rest + 1):
            if rest % p == 0:
                out.append((d, p, rest // p))
    return out


class _World(NamedTuple):
    """The world a layout is checked against, and the words the messages use for each setting."""

    size: int
    num_nodes: int
    names: Mapping[str, str]

    def describe(self) -> str:
        devices, nodes = self.names["devices"], self.names["num_nodes"]
        per_node = self.size // self.num_nodes if self.num_nodes and self.size % self.num_nodes == 0 else "?"
        return f"{devices}={per_node} x {nodes}={self.num_nodes} = {self.size} processes"

    def devices_for(self, processes: int) -> str:
        """The device setting that gives the smallest world that is a multiple of ``processes``."""
        nodes = max(1, self.num_nodes)
        smallest = processes * nodes // math.gcd(processes, nodes)
        text = f"{self.names['devices']}={smallest // nodes}"
        return text if nodes == 1 else f"{text} x {self.names['num_nodes']}={nodes}"

    def setting(self, sizes: Mapping[str, Size], axes: list[str]) -> str:
        return " x ".join(f"{self.names[a]}={sizes[a]!r}" if sizes[a] == "auto" else f"{self.names[a]}={sizes[a]}"
                          for a in axes)

    def valid(self, axes: list[str]) -> str:
        """The sizes of ``axes`` that fit this world (the other axes filling the rest)."""
        index = [MESH_AXES.index(a) for a in axes]
        combos = sorted({tuple(f[i] for i in index) for f in _factorizations(self.size)})
        shown = ", ".join("x".join(map(str, c)) for c in combos[:8]) + (", ..." if len(combos) > 8 else "")
        return f"{' x '.join(self.names[a] for a in axes)} = {shown}"

    def mismatch(self, sizes: Mapping[str, Size]) -> str:
        """Sizes that do not multiply (no 'auto') or divide (one 'auto') to the world size."""
        explicit = [a for a in MESH_AXES if sizes[a] != "auto"]
        auto = [a for a in MESH_AXES if sizes[a] == "auto"]
        product = math.prod(sizes[a] for a in explicit)
        if auto:
            return (f"{self.setting(sizes, explicit)} = {product} does not divide the world size "
                    f"{self.describe()}, so {self.names[auto[0]]}='auto' cannot be filled. Fix: sizes whose "
                    f"product divides {self.size} ({self.valid(explicit)}), or a world that is a multiple of "
                    f"{product} processes ({self.devices_for(product)}).")
        fits = self.devices_for(product)
        world = f"run {product} processes ({fits})" if product % max(1, self.num_nodes) == 0 else "run more processes"
        return (f"{self.setting(sizes, explicit)} = {product}, but the world size is {self.describe()}. Fix: sizes "
                f"whose product is {self.size} ({self.valid(explicit)}), set one of them to 'auto', or {world}.")

    def too_many_autos(self, sizes: Mapping[str, Size], auto: list[str]) -> str:
        divisors = ", ".join(str(d) for d in range(1, self.size + 1) if self.size % d == 0)
        return (f"Only one size can be 'auto', got {' and '.join(self.setting(sizes, [a]) for a in auto)} "
                f"on {self.describe()}. Fix: give "
                f"{' and '.join(self.names[a] for a in auto[1:])} an explicit size (a divisor of {self.size}: "
                f"{divisors}) and leave {self.names[auto[0]]}='auto'.")


def check_size(name: str, value: object) -> None:
    """Raise a ``ValueError`` unless ``value`` is a positive int or ``"auto"``."""
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not a size: pass a positive integer or 'auto'.")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1: pass a positive integer (1 disables this axis) or 'auto'.")


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
    """

    world_size: int
    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int
    data_replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "data_parallel", "pipeline_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if value == "auto":
                raise ValueError(
                    f"{name}='auto' must be resolved first: build the layout with ParallelLayout.resolve()."
                )
            check_size(name, value)
        sizes = {DATA_PARALLEL: self.data_parallel, PIPELINE_PARALLEL: self.pipeline_parallel,
                 TENSOR_PARALLEL: self.tensor_parallel}
        if math.prod(sizes.values()) != self.world_size:
            raise ValueError(_World(self.world_size, 1, DEFAULT_NAMES).mismatch(sizes))
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
    ) -> ParallelLayout:
        """Fill in at most one ``"auto"`` size from the world size and validate.

        Args:
            world_size: number of processes.
            data_parallel: size or ``"auto"``.
            pipeline_parallel: size or ``"auto"``.
            tensor_parallel: size or ``"auto"``.
            names: how the caller spells each setting in messages (keys of :data:`DEFAULT_NAMES`,
                e.g. ``{"pipeline_parallel": "strategy.pipeline_parallel_size", "devices": "trainer.devices"}``).
            num_nodes: nodes in the world (only for the messages' device counts).
            data_replicate: the HSDP split of the data axis (either, or both with
                product ``data_parallel``); None for both: one shard group (``data_replicate=1``).
            data_shard: the HSDP split of the data axis (either, or both with
                product ``data_parallel``); None for both: one shard group (``data_replicate=1``).

        Raises:
            ValueError: non-positive sizes, more than one ``"auto"``, sizes that do not multiply
                (or divide) to the world size, or an HSDP split that does not divide the data axis.
                The message names the settings, the world and the fix.
        """
        check_size("world_size", world_size)
        if world_size == "auto":
            raise ValueError("world_size cannot be 'auto': pass devices x num_nodes.")
        world = _World(world_size, num_nodes, {**DEFAULT_NAMES, **(names or {})})
        sizes = {DATA_PARALLEL: data_parallel, PIPELINE_PARALLEL: pipeline_parallel, TENSOR_PARALLEL: tensor_parallel}
        for axis, value in sizes.items():
            check_size(world.names[axis], value)
        auto = [axis for axis, value in sizes.items() if value == "auto"]
        if len(auto) > 1:
            raise ValueError(world.too_many_autos(sizes, auto))
        fixed = math.prod(v for v in sizes.values() if v != "auto")
        if (world_size % fixed) if auto else (fixed != world_size):
            raise ValueError(world.mismatch(sizes))
        if auto:
            sizes[auto[0]] = world_size // fixed
        replicas = _replica_groups(sizes[DATA_PARALLEL], data_replicate, data_shard, world.names)
        return cls(world_size, sizes[DATA_PARALLEL], sizes[PIPELINE_PARALLEL], sizes[TENSOR_PARALLEL], replicas)

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
        data = rank // (self.tensor_parallel * self.pipeline_parallel)
        return RankCoordinates(data, pipeline, tensor)

    def data_coordinates(self, rank: int) -> tuple[int, int]:
        """The (replica group, shard) position of global ``rank`` on the split data axis."""
        data = self.coordinates(rank).data
        return divmod(data, self.data_shard)

    def rank_at(self, data: int, pipeline: int, tensor: int) -> int:
        """The global rank at mesh position (data, pipeline, tensor)."""
        return (data * self.pipeline_parallel + pipeline) * self.tensor_parallel + tensor

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share ``rank``'s coordinates on every axis but ``axis``."""
        coords = self.coordinates(rank)
        if axis == DATA_PARALLEL:
            return [self.rank_at(d, coords.pipeline, coords.tensor) for d in range(self.data_parallel)]
        if axis == PIPELINE_PARALLEL:
            return [self.rank_at(coords.data, p, coords.tensor) for p in range(self.pipeline_parallel)]
        if axis == TENSOR_PARALLEL:
            return [self.rank_at(coords.data, coords.pipeline, t) for t in range(self.tensor_parallel)]
        if axis in DATA_AXES:
            replica, shard = self.data_coordinates(rank)
            data = ([r * self.data_shard + shard for r in range(self.data_replicate)] if axis == DATA_REPLICATE
                    else [replica * self.data_shard + s for s in range(self.data_shard)])
            return [self.rank_at(d, coords.pipeline, coords.tensor) for d in data]
        raise ValueError(f"Unknown mesh axis {axis!r}: use one of {MESH_AXES + DATA_AXES}.")

    def rank_map(self) -> list[tuple[int, RankCoordinates]]:
        """Every global rank with its coordinates, for the start-up table."""
        return [(rank, self.coordinates(rank)) for rank in range(self.world_size)]

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the 3-D DeviceMesh (needs an initialised default process group).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``.
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)

    def describe(self) -> str:
        """Short form such as ``dp2 x pp2 x tp1``, or ``dp4(2x2) x pp1 x tp1`` under HSDP."""
        data = f"dp{self.data_parallel}" + (f"({self.data_replicate}x{self.data_shard})" if self.hsdp_enabled else "")
        return f"{data} x pp{self.pipeline_parallel} x tp{self.tensor_parallel}"


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


def rank_map_rows(layout: ParallelLayout, limit: int = 16) -> dict[str, str]:
    """The rank map: which global ranks form each tensor, pipeline and data group.

    Args:
        layout: the resolved layout.
        limit: groups shown per axis before eliding.
    """
    rows = {}
    axes = [("tensor groups", TENSOR_PARALLEL), ("pipeline groups", PIPELINE_PARALLEL), ("data groups", DATA_PARALLEL)]
    if layout.hsdp_enabled:  # the data groups split: shard within a group, all-reduce across groups
        axes += [("data shard groups", DATA_SHARD), ("data replica groups", DATA_REPLICATE)]
    for label, axis in axes:
        groups = sorted({tuple(layout.group_ranks(axis, rank)) for rank in range(layout.world_size)})
        if len(groups[0]) == 1:
            continue
        shown = " ".join(str(list(g)) for g in groups[:limit]) + (" ..." if len(groups) > limit else "")
        rows[label] = shown
    rows["rank -> (data, pipeline, tensor)"] = " ".join(f"{r}:{tuple(c)}" for r, c in layout.rank_map()[: limit * 2])
    return rows
