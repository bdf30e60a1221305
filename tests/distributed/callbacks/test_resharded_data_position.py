"""A checkpoint written mid-epoch at data-parallel size 2 resumes at size 4 and on one process on the batches the
uninterrupted run took next, and with its losses: for ``resumable_loader`` (its sampler's position is global) and for
a plain ``DataLoader`` under the shuffling sampler Lightning injects (``ExactDataResume`` places it).

A global batch is compared by the sum of its inputs over all ranks: the same samples give the same sum however the
ranks split them. Negative controls: the plain loader without ``ExactDataResume`` (Lightning restarts the epoch at its
first batch) and rank 0's per-rank count read at another size (the loader before its position became global).
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_parallel.callbacks import ExactDataResume
from lightning_parallel.resumable_loader import resumable_loader
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.models import ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8
BATCHES_PER_EPOCH = 6
STEPS = 10  # into the second epoch
RESUMED_AT = (4, 8)  # mid-epoch in epoch 0 and in epoch 1


class GlobalBatches(pl.Callback):
    """The sum of every step's inputs over all ranks (the global batch's fingerprint)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        local = batch[0].double().sum().reshape(1)
        self.sums.append(round(float(trainer.strategy.reduce(local, reduce_op="sum")), 6))


class Data(pl.LightningDataModule):
    """The same shuffled samples through ``resumable_loader`` or a plain loader (Lightning injects the sampler)."""

    def __init__(self, kind: str, per_rank: int) -> None:
        super().__init__()
        self.kind, self.per_rank = kind, per_rank
        self.dataset = regression_dataset(GLOBAL_BATCH * BATCHES_PER_EPOCH, 16)

    def train_dataloader(self) -> DataLoader:
        if self.kind == "resumable_loader":
            return resumable_loader(self.dataset, self.per_rank, trainer=self.trainer, shuffle=True)
        return DataLoader(self.dataset, batch_size=self.per_rank, drop_last=True)


def _fit(kind, world_size, root, callbacks, ckpt_path=None):
    history, batches = LossHistory(), GlobalBatches()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=HybridParallelStrategy(), max_steps=STEPS, max_epochs=-1,
        logger=False, default_root_dir=str(root / "other"), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, use_distributed_sampler=kind == "plain", callbacks=[history, batches, *callbacks],
    )  # fmt: skip
    model = ResidualMLP(width=16, depth=2, optimizer="adamw", seed=1 if ckpt_path else 0)
    trainer.fit(model, datamodule=Data(kind, GLOBAL_BATCH // world_size), ckpt_path=ckpt_path)
    return {"losses": history.losses, "batches": batches.sums}


def _uninterrupted(rank, world_size, root):
    root = Path(root)
    out = {}
    for kind in ("resumable_loader", "plain"):
        saves = ModelCheckpoint(dirpath=root / kind, filename="step{step}", auto_insert_metric_name=False,
                                every_n_train_steps=1, save_top_k=-1)
        out[kind] = _fit(kind, world_size, root, [saves, ExactDataResume()])
    return out


def _resumed(rank, world_size, root):
    root = Path(root)
    out = {}
    for kind in ("resumable_loader", "plain"):
        for step in RESUMED_AT:
            out[kind, step] = _fit(kind, world_size, root, [ExactDataResume()], root / kind / f"step{step}.ckpt")
    out["plain without ExactDataResume", RESUMED_AT[0]] = _fit(
        "plain", world_size, root, [], root / "plain" / f"step{RESUMED_AT[0]}.ckpt")
    return out


def _compare(full, resumed):
    """(same global batches, largest loss difference) of a resumed run against the uninterrupted one."""
    step = len(full["batches"]) - len(resumed["batches"])
    same = resumed["batches"] == full["batches"][step:]
    diff = max_abs_difference(resumed["losses"], full["losses"][step:]) if same else float("inf")
    return same, diff


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The data-parallel-2 run, its losses and global batches, with a checkpoint after every step."""
    root = tmp_path_factory.mktemp("data2")
    full, _ = run_processes(_uninterrupted, 2, str(root), timeout=600)
    return root, full


@pytest.mark.parametrize("world_size", [4, 1], ids=["data 2 -> data 4", "data 2 -> one process"])
def test_a_mid_epoch_checkpoint_resumes_at_another_data_size_on_the_uninterrupted_batches(world_size, uninterrupted):
    root, full = uninterrupted
    per_rank = run_processes(_resumed, world_size, str(root), timeout=900)
    for rank, runs in enumerate(per_rank):
        for (kind, step), resumed in runs.items():
            same, diff = _compare(full["plain" if kind.startswith("plain") else kind], resumed)
            print(f"rank {rank}, {kind}, resumed at step {step}: same batches {same}, loss diff {diff:.2e}")
            if kind == "plain without ExactDataResume":
                assert not same, "negative control: Lightning alone restarts the epoch; this test could not tell"
                continue
            assert same, f"rank {rank}: {kind} resumed at step {step} on {world_size} ranks trained on other batches"
            assert diff < 1e-5, f"rank {rank}: {kind} resumed at step {step}: losses differ by {diff:.2e}"
