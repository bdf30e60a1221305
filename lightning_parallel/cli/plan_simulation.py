"""``lp-plan --simulate K``: the K best layouts built by simulation, predicted and simulated memory side by side.

The planner predicts each rank's bytes from the model's shape (:mod:`lightning_parallel.planner.memory`); the
simulation builds the layout for real in torch's fake world (:mod:`lightning_parallel.planner.simulation`) and
measures them as stored. For each of the K best hybrid-strategy layouts this composes the ``lp-train`` config that
runs it, simulates it, and shows the most loaded rank's parameters + gradients + optimizer state (and FSDP2's
gathered units) both ways. Where they differ the simulation wins: its peak -- stored and gathered bytes simulated,
activations still the planner's -- decides whether the layout fits, and the difference is printed.
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
    for prediction in plan.ranked[:count]:
        line = overrides(prediction.candidate, work, per_node, nodes)
        memory = prediction.memory
        predicted = SimulatedCandidate(prediction.candidate.name, memory.states, None, memory.working, None, None)
        if "strategy=hybrid" not in line:
            out.append(_replace(predicted, note="not simulated: lp-simulate builds the hybrid strategy's layouts"))
            continue
        try:
            simulation = _simulate(compose(user + line), plan.cluster.memory_per_device)
        except ValueError as error:
            out.append(_replace(predicted, note=f"refused: {str(error).splitlines()[0][:120]}"))
            continue
        top = max(simulation.classes, key=lambda c: c.parameter_bytes + c.gradient_bytes + c.optimizer_bytes)
        states = top.parameter_bytes + top.gradient_bytes + top.optimizer_bytes
        peak = states + top.gathered_bytes + memory.activations
        out.append(SimulatedCandidate(predicted.name, memory.states, states, memory.working, top.gathered_bytes,
                                      peak <= plan.cluster.memory_per_device))
    return out


def _replace(candidate: SimulatedCandidate, **changes: Any) -> SimulatedCandidate:
    from dataclasses import replace

    return replace(candidate, **changes)


def _simulate(cfg: Any, device_memory: float) -> Any:
    """The simulation of the layout ``lp-train`` would run with ``cfg`` (its preflight first)."""
    from hydra.utils import instantiate

    from lightning_parallel.cli.preflight import SETTING_NAMES, preflight, world_size_of
    from lightning_parallel.planner.simulation import simulate

    strategy, _ = preflight(cfg)
    return simulate(lambda: instantiate(cfg.model), strategy.options, world_size_of(cfg),
                    num_nodes=int(cfg.trainer.num_nodes), precision=str(cfg.trainer.get("precision", "32-true")),
                    device_memory=device_memory, names=SETTING_NAMES)


def print_simulated(rows: list[SimulatedCandidate]) -> None:
    """Predicted beside simulated bytes (GB), the difference, and the fit the simulation decides."""
    from lightning_parallel.runtime.console import print_table

    lines = []
    for row in rows:
        if row.simulated_states is None:
            lines.append((row.name, f"predicted states {row.predicted_states / _MIB:,.2f} MiB; {row.note}"))
            continue
        off = (row.predicted_states - row.simulated_states) / row.simulated_states
        states = f"{row.predicted_states / _MIB:,.2f} MiB, simulated {row.simulated_states / _MIB:,.2f} MiB"
        gathered = f"{row.predicted_working / _MIB:,.2f} MiB, simulated {row.simulated_gathered / _MIB:,.2f} MiB"
        lines.append((row.name, f"parameters + gradients + optimizer predicted {states} ({off:+.2%}); gathered "
                                f"predicted {gathered}; fits by simulation: {'yes' if row.fits else 'NO'}"))
    print_table("lp-plan: predicted and simulated memory (most loaded rank; the simulation wins)", lines)
