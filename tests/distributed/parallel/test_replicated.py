"""The plain replicated data axis (torch's DDP, ``parallel/replicated.py``): which layouts take it, and a model whose
step leaves a parameter without a gradient -- DDP's error at the next step without ``find_unused_parameters``,
one process's gradients with it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.replicated import replicates_plain
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import ResidualMLP

pytestmark = pytest.mark.slow
WIDTH, BATCH = 16, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = ResidualMLP(width=WIDTH, depth=2)
    model.unused = nn.Linear(WIDTH, WIDTH)  # never called by forward
    return model


def _steps(rank: int, world_size: int, find_unused: bool) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    reference, module = _model(), _model()
    layout = ParallelLayout(2, 2, 1, 1)
    options = ParallelOptions(data_parallel_size=2, find_unused_parameters=find_unused)
    ddp = parallelize(module, meshes=RunMeshes.build(layout, "cpu", 0), options=options,
                      adapter=adapt(module)).replicated
    x, y = torch.randn(2, BATCH, WIDTH, generator=torch.Generator().manual_seed(1)), torch.zeros(2, BATCH, WIDTH)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    diffs, error = [], None
    try:
        for step in range(2):
            module.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            module.pipeline_loss(ddp(x[step, half]), y[step, half]).backward()
            reference.pipeline_loss(reference(x[step]), y[step]).backward()
            diffs.append(max(float((p.grad - q.grad).abs().max()) for p, q in
                             zip(module.parameters(), reference.parameters()) if q.grad is not None))
    except RuntimeError as err:
        error = str(err)
    return {"diffs": diffs, "error": error, "unused_grad": module.unused.weight.grad is None,
            "plain": type(ddp).__name__}


def test_a_step_that_leaves_a_parameter_unused_is_an_error_without_the_option_and_exact_with_it():
    without = run_processes(_steps, 2, False, timeout=300)
    assert all(r["error"] and "find_unused_parameters" in r["error"] for r in without), without
    assert all(len(r["diffs"]) == 1 for r in without)  # the first step ran; DDP refuses at the next
    with_option = run_processes(_steps, 2, True, timeout=300)
    for r in with_option:
        assert r["error"] is None and r["plain"] == "DistributedDataParallel", r
        assert max(r["diffs"]) < 1e-6 and r["unused_grad"], r


@pytest.mark.parametrize(("sizes", "options", "precision", "plain"), [
    ((2, 1, 1), {}, "32-true", True),
    ((2, 2, 1), {"pipeline_parallel_size": 2}, "32-true", False),
    ((2, 1, 2), {"tensor_parallel_size": 2}, "32-true", False),
    ((2, 1, 1), {"zero_stage": 2}, "32-true", False),
    ((2, 1, 1), {"reduce_dtype": "bfloat16"}, "32-true", False),
    ((2, 1, 1), {}, "bf16-true", False),
    ((2, 1, 1), {}, "bf16-mixed", True),
    ((1, 1, 1), {}, "32-true", False),
])
def test_only_zero_0_alone_with_fp32_reductions_takes_the_plain_axis(sizes, options, precision, plain):
    layout = ParallelLayout(sizes[0] * sizes[1] * sizes[2], *sizes)
    assert replicates_plain(layout, ParallelOptions(data_parallel_size=sizes[0], **options), precision) is plain

