"""How layout errors read: the world a layout is checked against and the fix each message names.

Split from :mod:`lightning_parallel.layout` (which places ranks) because the wording of a refusal --
the sizes that would fit, the device count that would -- is a job of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, NamedTuple, Union

DATA_PARALLEL = "data_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
TENSOR_PARALLEL = "tensor_parallel"
CONTEXT_PARALLEL = "context_parallel"
MESH_AXES: tuple[str, str, str] = (DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL)

Size = Union[int, Literal["auto"]]


def factorizations(world_size: int) -> list[tuple[int, int, int]]:
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


class World(NamedTuple):
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
        combos = sorted({tuple(f[i] for i in index) for f in factorizations(self.size)})
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


def axes_after_context(sizes: Mapping[str, Size], context: int, world: World, full: World) -> str:
    """The other axes do not fit what context parallelism leaves of the world."""
    explicit = [a for a in MESH_AXES if sizes[a] != "auto"]
    product = math.prod(sizes[a] for a in explicit)
    return (f"{full.names[CONTEXT_PARALLEL]}={context} leaves {world.size} of the {full.describe()} to the other "
            f"axes, but {world.setting(sizes, explicit)} = {product} does not fit them. Fix: sizes whose product "
            f"{'divides' if len(explicit) < 3 else 'is'} {world.size} ({world.valid(explicit)}), or "
            f"{full.devices_for(product * context)}.")


def context_mismatch(world_size: int, context: object, world: World) -> str:
    name = world.names[CONTEXT_PARALLEL]
    divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
    devices = world.devices_for(context if isinstance(context, int) else 1)
    return (f"{name}={context!r} must divide the world size {world.describe()} (it takes an explicit size, not "
            f"'auto'). Fix: {name} among {divisors}, or {devices}.")
