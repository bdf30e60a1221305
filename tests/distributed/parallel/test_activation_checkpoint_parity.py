"""Activation checkpointing changes no loss: every mode equals the same layout without it, and one process.

Each launch trains, in the same processes, the layout without checkpointing and with each mode,
with dropout (the same seed in every run: recomputation must redraw the same masks) and
without dropout (then every run must also equal the single-process reference each rank
trains first). ``parallelize`` is driven by raw torch loops, as in ``test_compose.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.layout import DATA_PARALLEL, PIPELINE_PARALLEL, ParallelLayout
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.runner import PipelineRunner
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parallel.tp_runs import batches

pytestmark = pytest.mark.slow
STEPS, SAME_LAYOUT_TOL, ONE_PROCESS_TOL = 4, 1e-6, 1e-5
MODES = ("none", "full", "selective")


def _gpt(dropout: float):
    from examples.nlp.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=256, seq_len=16, d_model=32, n_layer=2, n_head=4, mlp_ratio=4, dropout=dropout).build()


def _reference() -> list[float]:
    model = _gpt(0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in batches(STEPS):
        optimizer.zero_grad()
        loss = model.pipeline_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _train(rank: int, world_size: int, cell: dict, mode, dropout: float) -> tuple[list[float], list[str]]:
    """Losses of STEPS steps of ``cell``'s layout with ``activation_checkpointing=mode``.

    And the checkpointed classes.
    """
    sizes = cell["sizes"]
    layout = ParallelLayout(world_size, *sizes)
    options = ParallelOptions(*sizes, zero_stage=cell.get("zero_stage", 0), microbatches=2,
                              schedule=cell.get("schedule", "1f1b"), stages_per_rank=cell.get("stages_per_rank", 1),
                              partition="uniform", activation_checkpointing=mode)
    module = _gpt(dropout)
    meshes = RunMeshes.build(layout, "cpu", options.zero_stage)
    mesh = meshes.run
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    runner = None
    if result.pipelined:
        runner = PipelineRunner(result.stages, result.stage_ids, result.num_stages, options.schedule,
                                options.microbatches, loss_fn=module.pipeline_loss, device=torch.device("cpu"),
                                group=mesh[PIPELINE_PARALLEL].get_group(), last_stage_rank=result.last_stage_rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    torch.manual_seed(1234)  # the same dropout stream in every run, on every rank
    losses = []
    for inputs, targets in batches(STEPS):
        share = inputs.shape[0] // layout.data_parallel
        start = layout.coordinates(rank).data * share
        inputs, targets = inputs[start : start + share], targets[start : start + share]
        optimizer.zero_grad()
        if runner is not None:
            loss = runner.train_step(inputs, targets)
        else:
            loss = module.pipeline_loss(module(inputs), targets)
            loss.backward()
        optimizer.step()
        loss = loss.detach().clone()
        if layout.data_parallel_enabled:
            dist.all_reduce(loss, group=mesh[DATA_PARALLEL].get_group())
            loss /= layout.data_parallel
        losses.append(float(loss))
    checkpointed = sorted({type(m).__name__ for m in module.modules() if activation_checkpoint.is_checkpointed(m)})
    return losses, checkpointed


def _cell(rank: int, world_size: int, cell: dict) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out = {"reference": _reference()}
    for dropout in (0.0, 0.1):
        for mode in cell.get("modes", MODES):
            out[(mode, dropout)] = _train(rank, world_size, cell, mode, dropout)
    # Negative control: recomputation that does not restore the RNG state redraws other dropout masks.
    exact = activation_checkpoint.checkpoint
    activation_checkpoint.checkpoint = lambda *a, **k: exact(*a, **{**k, "preserve_rng_state": False})
    try:
        out["no_rng_state"] = _train(rank, world_size, cell, "full", 0.1)
    finally:
        activation_checkpoint.checkpoint = exact
    return out


def _check(results: list[dict], modes: tuple[str, ...] = MODES) -> None:
    for rank, out in enumerate(results):
        for dropout in (0.0, 0.1):
            off = out[("none", dropout)][0]
            for mode in modes[1:]:
                losses, classes = out[(mode, dropout)]
                kind = "SelectiveCheckpointed" if mode == "selective" else "Checkpointed"  # FSDP2 may prefix it
                assert classes and all(c.startswith((kind, f"FSDP{kind}")) for c in classes), (rank, mode, classes)
                assert max_abs_difference(losses, off) < SAME_LAYOUT_TOL, (rank, mode, dropout, losses, off)
                if dropout == 0.0:
                    assert max_abs_difference(losses, out["reference"]) < ONE_PROCESS_TOL, (rank, mode, losses)
        assert max_abs_difference(out[("none", 0.0)][0], out["reference"]) < ONE_PROCESS_TOL
    # The control must fail the comparison on the ranks whose losses it reaches (the last stage computes them).
    worst = max(max_abs_difference(out["no_rng_state"][0], out[("none", 0.1)][0]) for out in results)
    assert worst > 1e-4, worst


@pytest.mark.parametrize(
    "cell",
    [{"sizes": (1, 2, 1)}, {"sizes": (1, 1, 2)}],
    ids=["pp2-1f1b", "tp2"],
)
def test_checkpointing_matches_no_checkpointing_and_one_process(cell):
    _check(run_processes(_cell, 2, cell, timeout=300))


@pytest.mark.extended
@pytest.mark.parametrize(
    "cell",
    [{"sizes": (1, 2, 1), "schedule": "interleaved_1f1b", "stages_per_rank": 2},
     # zero-bubble schedules refuse `selective` (see activation_checkpoint.check_schedule)
     {"sizes": (1, 2, 1), "schedule": "interleaved_zero_bubble", "stages_per_rank": 2, "modes": ("none", "full")},
     {"sizes": (1, 2, 1), "schedule": "zbv", "stages_per_rank": 2, "modes": ("none", "full")},
     {"sizes": (2, 2, 1), "zero_stage": 3}, {"sizes": (1, 2, 2)}],
    ids=["pp2-interleaved", "pp2-zero-bubble", "pp2-zbv", "dp2xpp2-zero3", "pp2xtp2"],
)
def test_checkpointing_under_more_layouts(cell):
    world = cell["sizes"][0] * cell["sizes"][1] * cell["sizes"][2]
    _check(run_processes(_cell, world, cell, timeout=600), cell.get("modes", MODES))
