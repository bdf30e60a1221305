"""Activation checkpointing through the strategies (Trainer, GPT recipe with dropout): the losses do not move.

The parallelize-level cells (``tests/distributed/parallel/test_activation_checkpoint_parity.py``)
prove each layout; these show the option reaches the layers through the Lightning strategies:
the pipeline strategy (its schedule executor) and DeepSpeed ZeRO-3 (applied before
``deepspeed.initialize``). Each launch fits every mode one after another; dropout 0.1 with
Lightning's seed, so recomputation must redraw the same masks.
"""

from __future__ import annotations

from functools import partial

import pytest

from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_losses, tiny_gpt

pytestmark = [pytest.mark.slow, pytest.mark.extended]
MODES = ("none", "full", "selective")
GLOBAL_BATCH, STEPS = 8, 4


def _strategy(kind: str, mode: str):
    if kind == "pipeline":
        from lightning_parallel.strategies import PipelineParallelStrategy

        return PipelineParallelStrategy(microbatches=2, activation_checkpointing=mode)
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    return DeepSpeedDataParallelStrategy(zero_stage=3, activation_checkpointing=mode)


def _modes(kind: str) -> tuple[str, ...]:
    return ("none", "full") if kind == "deepspeed" else MODES  # ZeRO-3 refuses selective (check_deepspeed_stage)


def _fit_modes(rank: int, world_size: int, kind: str, dropout: float) -> dict[str, list[float]]:
    data_parallel = world_size if kind == "deepspeed" else 1
    return {mode: fit_losses(rank, world_size, partial(_strategy, kind, mode), GLOBAL_BATCH, data_parallel, steps=STEPS,
                             model_factory=partial(tiny_gpt, dropout=dropout), dataset="text")
            for mode in _modes(kind)}


def _one_process(rank: int, world_size: int) -> list[float]:
    return fit_losses(rank, world_size, "auto", GLOBAL_BATCH, 1, steps=STEPS, model_factory=tiny_gpt, dataset="text")


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return run_processes(_one_process, 1, timeout=300)[0]


@pytest.mark.parametrize("kind", ["pipeline", "deepspeed"])
def test_every_mode_gives_the_losses_of_no_checkpointing(kind, reference):
    with_dropout = run_processes(_fit_modes, 2, kind, 0.1, timeout=900)
    without = run_processes(_fit_modes, 2, kind, 0.0, timeout=900)
    for rank in range(2):
        runs = with_dropout[rank]
        for mode in _modes(kind)[1:]:
            assert max_abs_difference(runs[mode], runs["none"]) < 1e-6, (kind, rank, mode, runs)
            assert max_abs_difference(without[rank][mode], reference) < 1e-5, (kind, rank, mode, without[rank])
