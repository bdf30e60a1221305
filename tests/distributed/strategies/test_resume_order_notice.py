"""The sampler trap at resume (issue 29): resuming another strategy's checkpoint with Lightning's injected shuffling
sampler says so once at start-up, with the fix; the runs that keep the writer's order say nothing.

A one-process Lightning run (default Trainer arguments, a ``shuffle=False`` loader) writes a single-file checkpoint;
tensor 2 resumes it. With ``use_distributed_sampler=True`` (Lightning's default) Lightning wraps the loader in a
shuffling ``DistributedSampler``, so the resumed batches are not the writer's: the notice, and the losses after
resume differ from one process resuming the same checkpoint. With ``use_distributed_sampler=False``, or resuming the
suite's own tensor-2 checkpoint, there is no notice.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import LossHistory, run_processes
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow
WIDTH, BATCH, SAMPLES = 16, 8, 16  # 2 steps per epoch: the checkpoint lies on an epoch boundary


class SequentialData(pl.LightningDataModule):
    """What a user writes: one ``shuffle=False`` loader, no sampler of their own."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_dataset(SAMPLES, WIDTH), batch_size=BATCH, shuffle=False)


def _trainer(devices: int, strategy, steps: int, history: LossHistory, sampler: bool = True) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[history], use_distributed_sampler=sampler)


class _Notices(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "resuming" in record.getMessage():
            self.messages.append(record.getMessage())


def _resume(rank: int, world_size: int, lightning_ckpt: str, suite_ckpt: str, sampler: bool, own: bool):
    notices = _Notices()
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(notices)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.INFO)
    if own:  # the suite's own checkpoint at this layout first (2 steps), then its resume
        writer = _trainer(world_size, Hybrid(tensor_parallel_size=2), 2, LossHistory(), sampler)
        writer.fit(ResidualMLP(width=WIDTH, depth=2, seed=0), datamodule=SequentialData())
        writer.save_checkpoint(suite_ckpt)
    history = LossHistory()
    trainer = _trainer(world_size, Hybrid(tensor_parallel_size=2), 6, history, sampler)
    trainer.fit(ResidualMLP(width=WIDTH, depth=2, seed=0), datamodule=SequentialData(),
                ckpt_path=suite_ckpt if own else lightning_ckpt)
    return {"notices": notices.messages, "losses": history.losses}


@pytest.fixture(scope="module")
def lightning_checkpoint(tmp_path_factory):
    """A plain Lightning single-device checkpoint after 2 steps, and the losses of steps 3-6 resumed from it in one
    process (Lightning's own resume)."""
    folder = tmp_path_factory.mktemp("resume_order")
    torch.manual_seed(0)
    history = LossHistory()
    trainer = _trainer(1, "auto", 2, history)
    trainer.fit(ResidualMLP(width=WIDTH, depth=2, seed=0), datamodule=SequentialData())
    trainer.save_checkpoint(folder / "single.ckpt")
    resumed = LossHistory()  # what the writer's own strategy does on resume: the reference order
    _trainer(1, "auto", 6, resumed).fit(ResidualMLP(width=WIDTH, depth=2, seed=0), datamodule=SequentialData(),
                                        ckpt_path=folder / "single.ckpt")
    return folder, resumed.losses


def test_resuming_a_one_process_checkpoint_with_lightnings_shuffling_sampler_says_so_once(lightning_checkpoint):
    folder, one_process = lightning_checkpoint
    ranks = run_processes(_resume, 2, str(folder / "single.ckpt"), "", True, False, timeout=600)
    assert len(ranks[0]["notices"]) == 1 and ranks[1]["notices"] == []
    notice = ranks[0]["notices"][0]
    assert "single.ckpt" in notice and "use_distributed_sampler=False" in notice and "resumable_loader" in notice
    assert "shards nothing at data-parallel size 1" in notice
    # what it warns about is real: the resumed batches are not the writer's
    assert max(abs(a - b) for a, b in zip(ranks[0]["losses"], one_process)) > 1e-3


def test_no_notice_when_the_order_is_the_writers(lightning_checkpoint, tmp_path):
    folder, one_process = lightning_checkpoint
    plain = run_processes(_resume, 2, str(folder / "single.ckpt"), "", False, False, timeout=600)
    assert plain[0]["notices"] == []  # the fix the notice names: same order, same losses
    assert max(abs(a - b) for a, b in zip(plain[0]["losses"], one_process)) < 1e-5
    own = run_processes(_resume, 2, "", str(tmp_path / "tp2.ckpt"), True, True, timeout=600)
    assert own[0]["notices"] == []  # the suite's own checkpoint at this layout: the same injected sampler
