"""ZeRO-3 under the Trainer communicates exactly like a raw ``deepspeed.initialize`` loop.

Counted, never timed: each Trainer step and one raw engine step after it (same model,
same resolved DeepSpeed config, same process group) run inside a
:class:`benchmarks.comm.CommCounter`. Before the fix in
``lightning_parallel/strategies/deepspeed/steps.py`` (``ZeRO3ForwardRedirection``), Lightning's
step redirection entered the LightningModule twice per step, DeepSpeed dropped its
parameter trace every step, and the Trainer step gathered every parameter twice and
broadcast 8 times.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

WIDTH, DEPTH, PER_RANK, STEPS = 32, 2, 4, 6
STEADY_FROM = 2  # DeepSpeed records its trace on steps 0-1 (both sides alike); later steps must reuse it


class _CountSteps(pl.Callback):
    """Counts each Trainer step, then runs and counts one raw engine step on the same batch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.trainer_steps: list[tuple[dict, dict]] = []
        self.raw_steps: list[tuple[dict, dict]] = []
        self._counter: Any = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        import deepspeed

        self.raw_model = ResidualMLP(WIDTH, DEPTH, optimizer="sgd")
        optimizer = torch.optim.SGD(self.raw_model.parameters(), lr=0.1, momentum=0.9)
        # The config the strategy resolved (micro-batch, clipping, ...): the raw side differs only in the loop.
        self.engine, *_ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.rank), model=self.raw_model, optimizer=optimizer,
            config=dict(trainer.strategy.config), dist_init_required=False,
        )

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        from benchmarks.comm import CommCounter

        self._counter = CommCounter().__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        from benchmarks.comm import CommCounter

        self._counter.__exit__(None, None, None)
        self.trainer_steps.append((dict(self._counter.counts), dict(self._counter.bytes)))
        inputs, targets = batch
        with CommCounter() as counter:
            loss = self.raw_model.pipeline_loss(self.engine(inputs), targets)
            self.engine.backward(loss, scale_wrt_gas=False)
            self.engine.step()
        self.raw_steps.append((dict(counter.counts), dict(counter.bytes)))


def _count_zero3(rank: int, world_size: int) -> dict[str, list[tuple[dict, dict]]]:
    dataset = regression_dataset(PER_RANK * world_size * STEPS, WIDTH)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    callback = _CountSteps(rank)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=DeepSpeedDataParallelStrategy(zero_stage=3), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[callback],
    )
    trainer.fit(
        ResidualMLP(WIDTH, DEPTH, optimizer="sgd"), train_dataloaders=DataLoader(dataset, PER_RANK, sampler=sampler)
    )
    return {"trainer": callback.trainer_steps, "raw": callback.raw_steps}


def _total(steps: list[tuple[dict, dict]]) -> tuple[Counter, Counter]:
    counts, nbytes = Counter(), Counter()
    for step_counts, step_bytes in steps[STEADY_FROM:]:
        counts.update(step_counts)
        nbytes.update(step_bytes)
    return counts, nbytes


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, list[tuple[dict, dict]]]]:
    return run_processes(_count_zero3, 2, timeout=180, env={"PYTHONWARNINGS": "ignore"})


def test_zero3_trainer_step_gathers_like_the_raw_engine(per_rank: list[dict]) -> None:
    for rank, result in enumerate(per_rank):
        assert len(result["trainer"]) == len(result["raw"]) == STEPS
        trainer_counts, trainer_bytes = _total(result["trainer"])
        raw_counts, raw_bytes = _total(result["raw"])
        # Not vacuous: the raw engine gathers partitioned parameters every step.
        assert raw_counts["all_gather_into_tensor"] > 0, (
            f"rank {rank}: the raw ZeRO-3 step gathered nothing: {raw_counts}"
        )
        assert trainer_counts["all_gather_into_tensor"] == raw_counts["all_gather_into_tensor"], (
            f"rank {rank}: Trainer {trainer_counts} vs raw {raw_counts} over steps {STEADY_FROM}..{STEPS - 1}"
        )
        assert trainer_bytes["all_gather_into_tensor"] == raw_bytes["all_gather_into_tensor"], (
            f"rank {rank}: Trainer gathered {trainer_bytes['all_gather_into_tensor']} B "
            f"vs raw {raw_bytes['all_gather_into_tensor']} B"
        )


def test_zero3_trainer_step_makes_no_extra_collectives(per_rank: list[dict]) -> None:
    # The trace checks of a re-recorded trace are broadcasts; a reused trace makes none.
    for rank, result in enumerate(per_rank):
        trainer_counts, trainer_bytes = _total(result["trainer"])
        raw_counts, raw_bytes = _total(result["raw"])
        assert trainer_counts["broadcast"] == 0, f"rank {rank}: Trainer steps broadcast: {trainer_counts}"
        assert trainer_counts == raw_counts, f"rank {rank}: Trainer {trainer_counts} vs raw {raw_counts}"
        assert trainer_bytes == raw_bytes, f"rank {rank}: Trainer {trainer_bytes} vs raw {raw_bytes}"
