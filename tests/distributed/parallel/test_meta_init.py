"""A model built in ``configure_model`` (on ``meta``) trains exactly as one process, on every layout, while each rank
allocates only its share.

The reference is the same module built with storage under Lightning's own single-device strategy and given the
suite's per-module seeded initialisation (:func:`~lightning_parallel.protocol.seeded_init`): so the
layouts agree with a run that involves none of the suite's machinery. The negative control is that reference
without :func:`seeded_init` (torch's sequential initialisation), which the layouts must *not* match.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.protocol import seeded_init
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.fit import fit_regression_epochs
from lightning_parallel.testing.models import DeferredResidualMLP, ResidualMLP

pytestmark = pytest.mark.slow

WIDTH, DEPTH, STEPS, BATCH = 32, 4, 3, 8


def _shares(module: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its local shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())


def fit_deferred(rank: int, world_size: int, **sizes) -> tuple[list[float], int]:
    module = DeferredResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    losses, _ = fit_regression_epochs(world_size, HybridParallelStrategy(**sizes), 1, batches=STEPS,
                                      global_batch=BATCH, module=module)
    return losses, _shares(module)


def fit_eager(rank: int, world_size: int, seeded: bool) -> list[float]:
    module = ResidualMLP(width=WIDTH, depth=DEPTH, optimizer="adamw")
    if seeded:
        seeded_init(module, seed=0)  # fit_regression_epochs seeds everything with 0: the meta runs' seed
    return fit_regression_epochs(1, "auto", 1, batches=STEPS, global_batch=BATCH, module=module)[0]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return run_processes(fit_eager, 1, True)[0]


LAYOUTS = {
    "one process": (1, {"data_parallel_size": 1}),
    "pp2": (2, {"pipeline_parallel_size": 2, "data_parallel_size": 1}),
    "tp2": (2, {"tensor_parallel_size": 2, "data_parallel_size": 1}),
    "dp2 zero3": (2, {"data_parallel_size": 2, "zero_stage": 3}),
    "pp2 x tp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 1}),
    "dp2 x pp2 zero3": (4, {"pipeline_parallel_size": 2, "data_parallel_size": 2, "zero_stage": 3}),
}


def _full_size() -> int:
    module = DeferredResidualMLP(width=WIDTH, depth=DEPTH)
    module.configure_model()
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_meta_built_model_matches_one_process_and_holds_only_its_share(name, reference):
    world, sizes = LAYOUTS[name]
    results = run_processes(partial(fit_deferred, **sizes), world, timeout=300)
    for losses, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-6, (name, losses, reference)
    held, full = [share for _, share in results], _full_size()
    if world == 1:
        assert held == [full]
    else:
        assert max(held) < full, f"a rank allocated the whole model ({held} of {full})"
    if "tensor_parallel_size" not in sizes:  # stages and FSDP2 shards partition the model exactly
        assert sum(held) == full, (held, full)


def test_torch_sequential_init_is_not_what_the_layouts_start_from(reference):
    unseeded = run_processes(fit_eager, 1, False)[0]
    assert abs(unseeded[0] - reference[0]) > 1e-3  # negative control: the comparison can fail
