"""``simulate``: a whole world of a layout built rank class by rank class in one CPU process (``lp-simulate``).

The suite's real path runs once per class of ranks that hold the same shapes (:mod:`.classes`), in torch's fake
process group on a ``meta`` model (:mod:`.rank_run`); what each class stores is measured as stored (:mod:`.held`),
its peak predicted against a device's memory (:mod:`.result`), and the classes are checked to hold every element of
every parameter as often as the layout says (:mod:`.whole_world`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner.simulation.classes import rank_classes
from lightning_parallel.planner.simulation.rank_run import ModelFactory, aliases, build_on_meta, simulate_rank
from lightning_parallel.planner.simulation.result import ClassResult, Simulation
from lightning_parallel.planner.simulation.whole_world import check_whole_world


def simulate(model_factory: ModelFactory, options: ParallelOptions, world_size: int, *, num_nodes: int = 1,
             precision: str = "32-true", device_memory: Optional[float] = None,
             names: Optional[Mapping[str, str]] = None, batch: Optional[Callable[[], Any]] = None) -> Simulation:
    """Simulate ``options`` on ``world_size`` ranks for the model ``model_factory`` builds.

    Args:
        model_factory: builds the model (a LightningModule with ``configure_optimizers``); called under
            ``torch.device("meta")``, its ``configure_model`` run there too, so nothing is allocated.
        options: the hybrid strategy's options (``strategy.options``).
        world_size: ranks in the world (devices x nodes).
        num_nodes: nodes (for the layout's messages).
        precision: the Trainer's precision name.
        device_memory: bytes per device to predict the fit against (``Cluster.memory_per_device``); None: no fit.
        names: how layout errors spell the sizes (default: the hybrid strategy's argument names).
        batch: builds one batch of a rank on ``meta`` as its data loader gives it (e.g. :func:`.step.token_batch`);
            with it each class runs one step, whose collectives and saved activations are measured; None: no step.

    Returns:
        The :class:`Simulation`: one :class:`ClassResult` per rank class.

    Raises:
        ValueError: a layout or model a real run refuses (the same message), or a failed whole-world check
            (:class:`~.whole_world.WholeWorldError`).
    """
    started = time.perf_counter()
    layout = options.layout(world_size, names, num_nodes)
    mailbox: dict = {}  # pipeline stage outputs, for the next position's input (positions run in order)
    classes = rank_classes(layout, options.zero_stage,
                           lambda rank: simulate_rank(rank, layout, options, model_factory, precision, batch, mailbox))
    canonical = set(aliases(build_on_meta(model_factory, precision)).values())
    checked = check_whole_world(classes, layout, options.zero_stage, canonical)
    settings = {"precision": precision, "zero_stage": options.zero_stage, "schedule": options.schedule,
                "microbatches": options.microbatches, "activation_checkpointing": str(options.activation_checkpointing)}
    return Simulation(world_size, layout.describe(), [ClassResult.of(c) for c in classes], device_memory, checked,
                      time.perf_counter() - started, settings)
