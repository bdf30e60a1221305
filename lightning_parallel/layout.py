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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Union

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL = "data_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
TENSOR_PARALLEL = "tensor_parallel"
MESH_AXES: tuple[str, str, str] = (DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL)

Size = Union[int, Literal["auto"]]


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
    """

    world_size: int
    data_parallel: int
    pipeline_parallel: int
    tensor_parallel: int

    def __post_init__(self) -> None:
        for name in ("world_size", "data_parallel", "pipeline_parallel", "tensor_parallel"):
            value = getattr(self, name)
            if value == "auto":
                raise ValueError(f"{name}='auto' must be resolved first: build the layout with ParallelLayout.resolve().")
            check_size(name, value)
        product = self.data_parallel * self.pipeline_parallel * self.tensor_parallel
        if product != self.world_size:
            valid = ", ".join(f"{d}x{p}x{t}" for d, p, t in _factorizations(self.world_size)[:8])
            raise ValueError(
                f"data_parallel x pipeline_parallel x tensor_parallel = {self.data_parallel}x{self.pipeline_parallel}"
                f"x{self.tensor_parallel} = {product}, but the world size (devices x num_nodes) is {self.world_size}. "
                f"Set one size to 'auto', change trainer.devices/num_nodes to {product}, or pick sizes whose product "
                f"is {self.world_size} (data x pipeline x tensor: {valid})."
            )

    @classmethod
    def resolve(
        cls,
        world_size: int,
        data_parallel: Size = "auto",
        pipeline_parallel: Size = 1,
        tensor_parallel: Size = 1,
    ) -> ParallelLayout:
        """Fill in at most one ``"auto"`` size from the world size and validate.

        Args:
            world_size: number of processes.
            data_parallel: size or ``"auto"``.
            pipeline_parallel: size or ``"auto"``.
            tensor_parallel: size or ``"auto"``.

        Raises:
            ValueError: non-positive sizes, more than one ``"auto"``, or sizes that do not
                multiply (or divide) to the world size. The message names the fix.
        """
        check_size("world_size", world_size)
        if world_size == "auto":
            raise ValueError("world_size cannot be 'auto': pass devices x num_nodes.")
        sizes = {"data_parallel": data_parallel, "pipeline_parallel": pipeline_parallel, "tensor_parallel": tensor_parallel}
        for name, value in sizes.items():
            check_size(name, value)
        auto = [name for name, value in sizes.items() if value == "auto"]
        if len(auto) > 1:
            raise ValueError(
                f"Only one size can be 'auto', got {auto}: give explicit sizes for all but one "
                f"(usually data_parallel='auto')."
            )
        if auto:
            fixed = math.prod(v for v in sizes.values() if v != "auto")
            if world_size % fixed:
                raise ValueError(
                    f"Cannot fill {auto[0]}='auto': the other sizes multiply to {fixed}, which does not divide the "
                    f"world size {world_size}. Use trainer.devices x num_nodes that is a multiple of {fixed}, or "
                    f"sizes whose product divides {world_size}."
                )
            sizes[auto[0]] = world_size // fixed
        return cls(world_size, sizes["data_parallel"], sizes["pipeline_parallel"], sizes["tensor_parallel"])

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in axis order ``(data, pipeline, tensor)``."""
        return (self.data_parallel, self.pipeline_parallel, self.tensor_parallel)

    @property
    def data_parallel_enabled(self) -> bool:
        return self.data_parallel > 1

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
        raise ValueError(f"Unknown mesh axis {axis!r}: use one of {MESH_AXES}.")

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
        """Short form such as ``dp2 x pp2 x tp1``."""
        return f"dp{self.data_parallel} x pp{self.pipeline_parallel} x tp{self.tensor_parallel}"
