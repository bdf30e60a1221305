"""Resuming a shuffled, data-parallel, max_steps-bounded run from any checkpoint -- mid-epoch, on an
epoch's last batch, at a validation end, or written after fit stopped -- trains on exactly the batches
of the uninterrupted run and reproduces its losses."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_parallel.callbacks import ExactDataResume
from lightning_parallel.resumable_loader import resumable_loader
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import BatchHistory, LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

BATCHES_PER_EPOCH = 4
STEPS = 10  # two and a half epochs
PER_RANK_BATCH = 4


class ShuffledData(pl.LightningDataModule):
    """A regression set served shuffled (a new order each epoch) and sharded over the data-parallel ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.dataset = regression_dataset(2 * BATCHES_PER_EPOCH * PER_RANK_BATCH, 32)

    def train_dataloader(self) -> DataLoader:
        return resumable_loader(self.dataset, PER_RANK_BATCH, trainer=self.trainer, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=PER_RANK_BATCH)


def _fit(root, callbacks, ckpt_path=None, max_steps=STEPS, seed=0):
    history, record = LossHistory(), BatchHistory()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(), max_steps=max_steps, max_epochs=-1,
        limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
        logger=False, default_root_dir=root / "other", enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[history, record, *callbacks],
    )  # fmt: skip
    trainer.fit(ResidualMLP(optimizer="adamw", seed=seed), datamodule=ShuffledData(), ckpt_path=ckpt_path)
    return trainer, history, record


def _resume_cases(rank, world_size, root, with_fix):
    root = Path(root)
    fix = [ExactDataResume()] if with_fix else []
    checkpoints = [
        ModelCheckpoint(dirpath=root, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=1,
                        save_top_k=-1),
        ModelCheckpoint(dirpath=root, filename="val{step}", auto_insert_metric_name=False, monitor=None, save_top_k=-1,
                        save_on_train_epoch_end=False),
    ]
    _, full, full_record = _fit(root, [*checkpoints, *fix])
    stopped, _, _ = _fit(root, fix, max_steps=2 * BATCHES_PER_EPOCH)  # stops at the end of epoch 1
    stopped.save_checkpoint(root / "stopped.ckpt")
    cases = {
        "mid-epoch (step 3)": ("step3.ckpt", 3),
        "epoch's last batch (step 4)": ("step4.ckpt", 4),
        "epoch's last batch (step 8)": ("step8.ckpt", 8),
        "validation end, mid-epoch (step 2)": ("val2.ckpt", 2),
        "validation end, epoch end (step 4)": ("val4.ckpt", 4),
        "after fit stopped (step 8)": ("stopped.ckpt", 8),
    }
    results = {}
    for name, (file, step) in cases.items():
        # A differently seeded model: everything it trains with must come from the checkpoint.
        _, resumed, record = _fit(root, fix, ckpt_path=str(root / file), seed=1)
        results[name] = {
            "batches_match": record.batches == full_record.batches[step:],
            "loss_diff": max_abs_difference(resumed.losses, full.losses[step:])
            if len(resumed.losses) == STEPS - step else float("inf"),
        }
    torch.distributed.barrier()
    return results


@pytest.mark.parametrize("with_fix", [True, False], ids=["ExactDataResume", "without"])
def test_resume_trains_on_the_uninterrupted_runs_batches(with_fix, tmp_path):
    results = run_processes(_resume_cases, 2, str(tmp_path), with_fix, timeout=900)
    print({name: (case["batches_match"], case["loss_diff"]) for name, case in results[0].items()})
    for rank, cases in enumerate(results):
        if with_fix:
            for name, case in cases.items():
                assert case["batches_match"], f"rank {rank}, {name}: the resumed run trained on other batches"
                assert case["loss_diff"] < 1e-6, f"rank {rank}, {name}: losses differ by {case['loss_diff']:.2e}"
        else:  # Lightning alone: exact mid-epoch, but both kinds of epoch-end checkpoint skip data.
            assert cases["mid-epoch (step 3)"]["batches_match"]
            assert not cases["epoch's last batch (step 4)"]["batches_match"]
            assert not cases["after fit stopped (step 8)"]["batches_match"]
