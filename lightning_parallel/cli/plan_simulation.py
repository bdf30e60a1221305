"""``lp-plan --simulate K``: the K best layouts built by simulation, predicted and simulated memory side by side,
and re-ranked by the simulation.

The planner predicts each rank's bytes from the model's shape (:mod:`lightning_parallel.planner.memory`); the
simulation builds the layout for real in torch's fake world (:mod:`lightning_parallel.planner.simulation`), runs one
step on ``meta`` and measures them as stored. For each of the K best hybrid-strategy layouts this composes the
``lp-train`` config that runs it, simulates it, and shows the most loaded rank's parameters + gradients + optimizer
state, FSDP2's gathered units and activations both ways. Where they differ the simulation wins: its peak (the
planner's activations only where the step could not run on ``meta``) decides whether the layout fits, the K are
re-ranked -- layouts that fit by simulation first, in the planner's order of step time; then those that do not, the
least over first -- and every move and difference is printed. (Memory decides the fit only: the simulation does not
re-time a step.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

_MIB = 2**20


@dataclass(frozen=True)
class SimulatedCandidate:
    """One ranked layout, predicted and simulated (bytes of the most loaded rank)."""

    name: str
    predicted_states: float
    simulated_states: Optional[float]
    predicted_working: float
    simulated_gathered: Optional[float]
    fits: Optional[bool]
    note: str = ""
    predicted_activations: float = 0.0
    simulated_activations: Optional[float] = None
    peak: Optional[float] = None
    planner_rank: int = 0
    line: tuple[str, ...] = ()


def simulate_candidates(plan: Any, user: list[str], work: Any, per_node: int, nodes: int, count: int,
                        compose: Callable[[list[str]], Any]) -> list[SimulatedCandidate]:
    """Simulate the ``count`` best layouts of ``plan`` (DDP and DeepSpeed layouts are shown as not simulated).

    Args:
        plan: the planner's :class:`~lightning_parallel.planner.plan.Plan`.
        user: the user's Hydra overrides.
        work: the workload (batch) the plan was made for.
        per_node, nodes: devices per node and nodes.
        count: how many of the ranked layouts to simulate.
        compose: composes ``lp-train``'s config from overrides (``lp-plan``'s own).
    """
    from lightning_parallel.planner.plan import overrides

    out = []
    for rank, prediction in enumerate(plan.ranked[:count], start=1):
        line = overrides(prediction.candidate, work, per_node, nodes)
        memory = prediction.memory
        predicted = SimulatedCandidate(prediction.candidate.name, memory.states, None, memory.working, None, None,
                                       predicted_activations=memory.activations, planner_rank=rank, line=tuple(line))
        if "strategy=hybrid" not in line:
            out.append(_replace(predicted, note="not simulated: lp-simulate builds the hybrid strategy's layouts"))
            continue
        try:
            simulation = _simulate(compose(user + line), plan.cluster.memory_per_device)
        except ValueError as error:
            out.append(_replace(predicted, note=f"refused: {str(error).splitlines()[0][:120]}"))
            continue
        top = max(simulation.classes, key=lambda c: c.peak_bytes + (memory.activations if c.activation_bytes is None
                                                                    else 0))
        states = top.parameter_bytes + top.gradient_bytes + top.optimizer_bytes
        activations = top.activation_bytes
        peak = states + top.gathered_bytes + (memory.activations if activations is None else activations)
        out.append(_replace(predicted, simulated_states=states, simulated_gathered=top.gathered_bytes,
                            simulated_activations=activations, peak=peak,
                            fits=peak <= plan.cluster.memory_per_device))
    return out


def rerank(rows: list[SimulatedCandidate], device_memory: float) -> list[SimulatedCandidate]:
    """``rows`` in the simulation's order: those that fit by simulation (or, not simulated, by the planner) first,
    in the planner's order (step time); then those that do not fit by simulation, the least over first.

    Args:
        rows: the simulated candidates, in the planner's order.
        device_memory: bytes per device.
    """
    def key(row: SimulatedCandidate) -> tuple:
        if row.peak is None or row.fits:
            return (0, row.planner_rank)
        return (1, row.peak - device_memory)

    return sorted(rows, key=key)


def _replace(candidate: SimulatedCandidate, **changes: Any) -> SimulatedCandidate:
    from dataclasses import replace

    return replace(candidate, **changes)


def _simulate(cfg: Any, device_memory: float) -> Any:
    """The simulation of the layout ``lp-train`` would run with ``cfg`` (its preflight first)."""
    from hydra.utils import instantiate

    from lightning_parallel.cli.preflight import SETTING_NAMES, preflight, world_size_of
    from lightning_parallel.planner.simulation import simulate
    from lightning_parallel.planner.simulation.step import batch_of

    strategy, _ = preflight(cfg)
    return simulate(lambda: instantiate(cfg.model), strategy.options, world_size_of(cfg),
                    num_nodes=int(cfg.trainer.num_nodes), precision=str(cfg.trainer.get("precision", "32-true")),
                    device_memory=device_memory, names=SETTING_NAMES, batch=batch_of(cfg.get("data")))


def print_simulated(rows: list[SimulatedCandidate], device_memory: float) -> None:
    """Predicted beside simulated bytes (MiB) and the differences, in the simulation's order (:func:`rerank`), the
    moves it made, and the winning overrides by simulation."""
    from lightning_parallel.runtime.console import print_table

    ordered = rerank(rows, device_memory)
    lines = []
    for position, row in enumerate(ordered, start=1):
        moved = f"#{position} (planner #{row.planner_rank})"
        if row.simulated_states is None:
            lines.append((row.name, f"{moved}: predicted states {row.predicted_states / _MIB:,.2f} MiB; {row.note}"))
            continue
        lines.append((row.name, f"{moved}: {_differences(row)}; fits by simulation: {'yes' if row.fits else 'NO'}"))
    print_table("lp-plan: predicted and simulated memory (most loaded rank; the simulation wins and re-ranks)", lines)
    best = next((row for row in ordered if row.fits), None)
    if best is not None and best.planner_rank != 1:
        print(f"best by simulation: {best.name} (planner #{best.planner_rank}); run it with:\n  lp-train "
              + " ".join(best.line))
    elif best is None:
        print("none of the simulated layouts fits by simulation: simulate more (--simulate K) or use more devices")


def _differences(row: SimulatedCandidate) -> str:
    """Predicted vs simulated states, gathered parameters and activations, each with its relative difference."""
    pairs = [("parameters + gradients + optimizer", row.predicted_states, row.simulated_states),
             ("gathered", row.predicted_working, row.simulated_gathered),
             ("activations", row.predicted_activations, row.simulated_activations)]
    parts = []
    for what, predicted, simulated in pairs:
        if simulated is None:
            parts.append(f"{what} predicted {predicted / _MIB:,.2f} MiB (not simulated: the planner's is used)")
            continue
        off = f" ({(predicted - simulated) / simulated:+.2%})" if simulated else ""
        parts.append(f"{what} predicted {predicted / _MIB:,.2f} MiB, simulated {simulated / _MIB:,.2f} MiB{off}")
    return "; ".join(parts)
