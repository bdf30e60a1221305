"""What a simulation found: per rank class, bytes as stored and the predicted peak against the device's memory.

``simulation.json`` is :meth:`Simulation.to_json`; the console table is :meth:`Simulation.rows`.

The predicted peak of a rank is what it stores after a step (parameters, gradients, optimizer state) plus what a step
holds on top at once: FSDP2's gathered units (:mod:`.gathered`) and the activations of the micro-batches in flight
where they were measured (``activation_bytes``; None: not measured, left out of the peak and said so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_parallel.planner.simulation.classes import RankClass

_MIB = 2**20


@dataclass(frozen=True)
class ClassResult:
    """One rank class's figures (bytes per rank of the class).

    Attributes:
        ranks: the ranks of the class.
        why: why they are one class.
        stages: the pipeline stages they hold.
        parameter_bytes, gradient_bytes, optimizer_bytes: as stored after the first optimizer step.
        gathered_bytes: FSDP2's unsharded units held at once during a step.
        padding_bytes: of ``parameter_bytes``, what FSDP2's padding adds to the local shapes.
        activation_bytes: activations of the micro-batches in flight (None: not measured).
        peak_bytes: the predicted peak.
        collectives: the communication of one step by kind, mesh axis and bytes (empty: not measured).
        notes: how the simulation differs from a real run.
        seconds: the time its representative took.
        details: further figures of its step (pipelining: ``activation_bytes_per_microbatch`` and
            ``microbatches_in_flight`` per stage).
    """

    ranks: tuple[int, ...]
    why: str
    stages: tuple[int, ...]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    gathered_bytes: int
    activation_bytes: Optional[int]
    peak_bytes: int
    padding_bytes: int = 0
    collectives: tuple[dict[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, rank_class: RankClass) -> ClassResult:
        """The figures of a simulated class."""
        record = rank_class.record
        activations = record.extra.get("activation_bytes")
        peak = (record.parameter_bytes + record.gradient_bytes + record.optimizer_bytes + record.gathered_bytes
                + (activations or 0))
        return cls(rank_class.ranks, rank_class.why, record.stages, record.parameter_bytes, record.gradient_bytes,
                   record.optimizer_bytes, record.gathered_bytes, activations, peak, record.padding_bytes,
                   tuple(record.extra.get("collectives", ())), record.notes, record.seconds,
                   {k: v for k, v in record.extra.items() if k not in ("activation_bytes", "collectives")})


@dataclass
class Simulation:
    """A whole world simulated class by class.

    Attributes:
        world_size: ranks in the world.
        layout: the layout's short form (``dp64(8x8) x cp2 x pp4 x tp8``).
        classes: one :class:`ClassResult` per rank class.
        device_memory: bytes per device of the cluster (None: no cluster given).
        elements_checked: parameter elements the whole-world check counted (each once).
        seconds: wall time of the whole simulation.
    """

    world_size: int
    layout: str
    classes: list[ClassResult]
    device_memory: Optional[float] = None
    elements_checked: int = 0
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def fits(self) -> Optional[bool]:
        """Whether every class's predicted peak fits the device's memory (None without a cluster)."""
        if self.device_memory is None:
            return None
        return all(c.peak_bytes <= self.device_memory for c in self.classes)

    def margin(self, result: ClassResult) -> Optional[float]:
        """Bytes left on the device at the class's peak (negative: by how much it does not fit)."""
        return None if self.device_memory is None else self.device_memory - result.peak_bytes

    def to_json(self) -> dict[str, Any]:
        """``simulation.json``'s content."""
        classes = []
        for result in self.classes:
            entry = {k: getattr(result, k) for k in ClassResult.__dataclass_fields__}
            entry.update(ranks=list(result.ranks), stages=list(result.stages), collectives=list(result.collectives),
                         notes=list(result.notes), rank_count=len(result.ranks), margin_bytes=self.margin(result),
                         fits=None if self.device_memory is None else result.peak_bytes <= self.device_memory)
            classes.append(entry)
        return {"world_size": self.world_size, "layout": self.layout, "classes": classes, "fits": self.fits,
                "device_memory_bytes": self.device_memory, "whole_world_check": "passed",
                "elements_checked": self.elements_checked, "seconds": self.seconds, "settings": self.settings}

    def rows(self) -> list[tuple[str, ...]]:
        """One row per class: ranks, stages, parameters, gradients, optimizer, gathered, activations, peak, fits."""
        rows = []
        for result in self.classes:
            margin = self.margin(result)
            fit = "-" if margin is None else (f"yes ({margin / _MIB:,.0f} MiB free)" if margin >= 0
                                               else f"NO ({-margin / _MIB:,.0f} MiB over)")
            rows.append((_ranks(result.ranks), ",".join(map(str, result.stages)) or "-",
                         *(f"{b / _MIB:,.1f}" for b in (result.parameter_bytes, result.gradient_bytes,
                                                         result.optimizer_bytes, result.gathered_bytes)),
                         "-" if result.activation_bytes is None else f"{result.activation_bytes / _MIB:,.1f}",
                         f"{result.peak_bytes / _MIB:,.1f}", fit))
        return rows


def _ranks(ranks: tuple[int, ...]) -> str:
    """``0-7`` for a run, ``0,2,4 (+5)`` for a long list."""
    if len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"{ranks[0]}-{ranks[-1]}"
    shown = ",".join(map(str, ranks[:4]))
    return f"{shown} (+{len(ranks) - 4}, {len(ranks)} ranks)" if len(ranks) > 4 else shown
