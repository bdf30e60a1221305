"""``parallelize`` alone -- no Trainer, no Lightning strategy -- gives one process's losses under every layout.

Each rank trains the single-process reference itself first (on CPU with one thread it is
bit-for-bit a separate one-process run), then a copy parallelised by
:func:`lightning_parallel.parallel.compose.parallelize`, driven by raw torch loops: the
pipeline runner when the module was cut into stages, ``module(x)`` otherwise -- through the DDP wrapper
``parallelize`` returns where ZeRO 0 is the only axis (``result.replicated``), as the strategy does.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.layout import DATA_PARALLEL, PIPELINE_PARALLEL, ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.data import deferred_gradient_sync
from lightning_parallel.parallel.grad_norm_clipping import clip_grad_norm_
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.runner import PipelineRunner
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parallel.tp_runs import BATCH, batches, tiny_gpt

pytestmark = pytest.mark.slow
STEPS, TOL = 4, 1e-5


def _reference(steps: int) -> list[float]:
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in batches(steps):
        optimizer.zero_grad()
        loss = model.pipeline_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        losses.append(float(loss))
    return losses


def _data_shard(inputs, targets, layout: ParallelLayout, rank: int):
    size = inputs.shape[0] // layout.data_parallel
    start = layout.coordinates(rank).data * size
    return inputs[start : start + size], targets[start : start + size]


def _train_parallel(
    rank: int, world_size: int, sizes: tuple[int, int, int], zero_stage: int, average: bool = True
) -> dict:
    layout = ParallelLayout(world_size, *sizes)
    meshes = RunMeshes.build(layout, "cpu", zero_stage)
    mesh = meshes.run
    options = ParallelOptions(*sizes, zero_stage=zero_stage, microbatches=2, schedule="gpipe", partition="uniform")
    module = copy.deepcopy(tiny_gpt())
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    runner = None
    if result.pipelined:
        runner = PipelineRunner(result.stages, result.stage_ids, result.num_stages, options.schedule,
                                options.microbatches, loss_fn=module.pipeline_loss, device=torch.device("cpu"),
                                group=mesh[PIPELINE_PARALLEL].get_group(), last_stage_rank=result.last_stage_rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    pp_group = mesh[PIPELINE_PARALLEL].get_group() if layout.pipeline_parallel_enabled else None
    losses = []
    for inputs, targets in batches(STEPS):
        inputs, targets = _data_shard(inputs, targets, layout, rank)
        optimizer.zero_grad()
        # FSDP2 or DDP averages over the data axis during backward; the negative control never lets it.
        forward = result.replicated or module
        with deferred_gradient_sync(forward, zero_stage, hsdp=False) if not average else contextlib.nullcontext():
            if runner is not None:
                loss = runner.train_step(inputs, targets)
            else:
                loss = module.pipeline_loss(forward(inputs), targets)
                loss.backward()
        clip_grad_norm_(list(module.parameters()), 0.5, pipeline_group=pp_group)
        optimizer.step()
        loss = loss.detach().clone()
        if layout.data_parallel_enabled:
            dist.all_reduce(loss, group=mesh[DATA_PARALLEL].get_group())
            loss /= layout.data_parallel
        losses.append(float(loss))
    split = result.split
    return {"losses": losses, "reference": _reference(STEPS), "plan": sorted(result.plan),
            "bounds": split.bounds if split else None, "stage_ids": result.stage_ids}


def _run(rank: int, world_size: int, sizes, zero_stage) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return _train_parallel(rank, world_size, sizes, zero_stage)


@pytest.mark.parametrize(
    ("sizes", "zero_stage"),
    # pp2 and tp2 alone are covered by pp2xtp2 (and by the strategy parity tests); kept short for the suite's budget.
    [((2, 1, 1), 0), ((2, 1, 1), 3), ((1, 2, 2), 0), ((2, 2, 1), 2)],
    ids=["dp2", "dp2-zero3", "pp2xtp2", "dp2xpp2-zero2"],
)
def test_parallelize_without_a_trainer_matches_one_process(sizes, zero_stage):
    world = sizes[0] * sizes[1] * sizes[2]
    assert BATCH % (sizes[0] * 2) == 0
    results = run_processes(_run, world, sizes, zero_stage, timeout=300)
    for rank, result in enumerate(results):
        assert max_abs_difference(result["losses"], result["reference"]) < TOL, (rank, result)
        if sizes[2] > 1:
            assert {"blocks.0.attn.q", "blocks.0.attn.out", "blocks.1.mlp"} <= set(result["plan"])
        if sizes[1] > 1:
            # gpipe on 2 ranks, uniform partition: rank p holds stage p of 2.
            assert len(result["bounds"]) == 3 and result["stage_ids"] == ((rank // sizes[2]) % 2,)


def test_a_broken_composition_fails_the_comparison():
    """Negative control: data-parallel replicas that skip the gradient average drift from one process."""
    results = run_processes(_run_unaveraged, 2, timeout=300)
    assert max(max_abs_difference(r["losses"], r["reference"]) for r in results) > 1e-4


def _run_unaveraged(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return _train_parallel(rank, world_size, (2, 1, 1), 0, average=False)
