"""Checkpoints load under other layouts, survive a crash mid-write, refuse tampering, and export to one file."""

import os
import pickle
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import checkpoints as ckpt
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset
from tests.distributed.saved_checkpoints import BATCHES, GLOBAL_BATCH, SAVE_LAYOUTS
from tests.distributed.saved_checkpoints import fit as _fit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(hybrid_checkpoints):
    """One checkpoint per layout of ``SAVE_LAYOUTS`` (4 processes), taken at the end of epoch 0."""
    return hybrid_checkpoints


def _load_all(rank, world_size, root, targets, reference=False):
    out = {"reference": _fit(1, "auto", 2)[0]} if reference else {}  # the uninterrupted single-process run
    for target, sizes in targets.items():
        for name in SAVE_LAYOUTS:
            losses, _ = _fit(world_size, Hybrid(**sizes), 2, ckpt_path=str(Path(root) / f"{name}.ckpt"), seed=1)
            out[(target, name)] = losses
    return out


def test_checkpoints_load_under_other_layouts_and_training_continues(saved):
    loads = {
        1: {"single": {}},
        2: {"tp2": {"data_parallel_size": 1, "tensor_parallel_size": 2}},
        4: {"pp4": {"data_parallel_size": 1, "pipeline_parallel_size": 4}, "dp4-zero3": {"zero_stage": 3}},
    }
    reference = None
    for world, targets in loads.items():
        for rank, result in enumerate(run_processes(_load_all, world, str(saved), targets, world == 1, timeout=900)):
            reference = result.pop("reference", reference)
            for (target, source), losses in result.items():
                assert len(losses) == BATCHES
                diff = max_abs_difference(losses, reference[BATCHES:])
                assert diff < 1e-5, f"saved under {source}, loaded under {target}, rank {rank}: {diff:.2e}"


class _CrashOnFourthSave(Hybrid):
    """Dies (all ranks, like a node failure) after writing the shards of its fourth checkpoint, before the commit.

    Saves: step2.ckpt, last.ckpt (step 2), step4.ckpt, then last.ckpt (step 4) is torn.
    """

    saves = 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        type(self).saves += 1
        if type(self).saves < 4:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        state = {"state_dict": checkpoint.pop("state_dict")}
        ckpt.write_shards(Path(filepath), state)
        self.barrier()
        os._exit(17)


def _crash_then_resume(rank, world_size, root, phase):
    saver = lambda: ModelCheckpoint(dirpath=root, filename="step{step}", save_last=True, every_n_train_steps=2,  # noqa: E731
                                    save_top_k=-1)
    if phase == "crash":
        _fit(world_size, _CrashOnFourthSave(pipeline_parallel_size=2, data_parallel_size=1), 2, callbacks=[saver()])
    return _fit(world_size, Hybrid(pipeline_parallel_size=2, data_parallel_size=1), 1, callbacks=[saver()],
                ckpt_path="last")[1].global_step


def test_a_crash_during_a_checkpoint_write_resumes_from_the_previous_complete_one(tmp_path):
    from lightning_parallel.testing import DistributedRunError

    with pytest.raises(DistributedRunError, match="exited with code 17"):
        run_processes(_crash_then_resume, 2, str(tmp_path), "crash", timeout=600)
    assert (tmp_path / "last.ckpt").is_dir() and (tmp_path / ".last.ckpt.partial").is_dir()  # the torn write is hidden
    meta = torch.load(tmp_path / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == 2  # the complete one, not the torn one at step 4
    steps = run_processes(_crash_then_resume, 2, str(tmp_path), "resume", timeout=600)
    assert steps == [4, 4]  # resumed at step 2, ran the remaining 2 batches of the epoch


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_parallel_pwned",))


def _load_tampered(rank, world_size, path):
    _fit(world_size, Hybrid(), 2, ckpt_path=path)


@pytest.mark.parametrize("target", ["meta.pt", ".metadata"])
def test_a_checkpoint_with_a_malicious_pickle_is_refused(saved, tmp_path, target):
    import shutil

    path = tmp_path / "tampered.ckpt"
    shutil.copytree(saved / "dp2xtp2.ckpt", path)
    with open(path / target, "wb") as f:
        pickle.dump(_Payload(), f)
    from lightning_parallel.testing import DistributedRunError

    with pytest.raises(DistributedRunError, match="Refusing"):
        run_processes(_load_tampered, 1, str(path), timeout=600)
    assert not Path("/tmp/lightning_parallel_pwned").exists()


def test_export_writes_one_plain_state_dict_loadable_without_distributed(saved, tmp_path):
    single = run_processes(_weights_after_resume, 1, str(saved / "pp2xtp2.ckpt"))[0]
    out = ckpt.export_state_dict(saved / "pp2xtp2.ckpt", tmp_path / "model.pt")
    plain = torch.load(out, weights_only=True)
    fresh = ResidualMLP()
    fresh.load_state_dict(plain)  # strict: exactly the module's keys and shapes
    for name, value in plain.items():
        torch.testing.assert_close(value, single[name], rtol=0, atol=0)


def _weights_after_resume(rank, world_size, path):
    """Weights as the strategy loads them (world 1), to compare with the export."""
    strategy = Hybrid()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = ResidualMLP(seed=5)
    data = FixedOrderData(regression_dataset(GLOBAL_BATCH, 32), batch_size=GLOBAL_BATCH)
    loader = torch.utils.data.DataLoader([x for x, _ in data.dataset], batch_size=16)
    trainer.predict(model, dataloaders=loader, ckpt_path=path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
