"""Checkpoints written by Lightning's own strategies and by DeepSpeed resume under the suite's layouts.

Each source trains 4 AdamW steps (one epoch, fp32) and checkpoints at the epoch end; the suite's
strategy resumes it with ``Trainer.fit(ckpt_path=...)`` for 4 more steps. The reference is the
same save-and-resume on one process (Lightning's single-device strategy): every rank must see
its last 4 losses within 1e-5 and end with the same optimizer step count. The resumed module
is seeded differently, so weights that did not come from the checkpoint would show.

One launch per world size makes the sources, one per world size resumes them all (see the
module-scoped fixtures).
"""

from __future__ import annotations

import os
import pickle
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_regression_epochs, optimizer_step_counts
from lightning_parallel.testing.models import ResidualMLP

# The module's fits took ~7 minutes on a 2-core machine shared with other jobs (load ~19): more than the
# default per-test limit, which counts the module fixtures against the first test.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(1500)]

BATCHES = 4
GLOBAL_BATCH = 16
TOLERANCE = 1e-5
# target name -> (world size, strategy arguments, sources it resumes)
TARGETS = {
    "dp2xpp2": (4, {"pipeline_parallel_size": 2}, ["single"]),
    "pp2xtp2": (4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, ["single"]),
    "dp2xtp2": (4, {"tensor_parallel_size": 2}, ["zero2", "zero3"]),
    "tp2": (2, {"data_parallel_size": 1, "tensor_parallel_size": 2}, ["ddp"]),
    "pp2": (2, {"data_parallel_size": 1, "pipeline_parallel_size": 2}, ["model_parallel", "zero2", "zero3"]),
}


class TensorAndFullyShardedMLP(ResidualMLP):
    """The MLP as a user of Lightning's ModelParallelStrategy writes it: TP in blocks, FSDP2 over data."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh
        for block in self.blocks.values():
            parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])


_fit = partial(fit_regression_epochs, batches=BATCHES, global_batch=GLOBAL_BATCH)


def _saver(root, name):
    return ModelCheckpoint(dirpath=root, filename=name, save_top_k=-1, save_on_train_epoch_end=True)


def _single_process(rank, world_size, root):
    """The single-device source, and the reference: the same save-and-resume on this one process."""
    _fit(1, "auto", 1, callbacks=[_saver(root, "single")])
    losses, trainer = _fit(1, "auto", 2, ckpt_path=str(Path(root) / "single.ckpt"), seed=1)
    return {"losses": losses, "steps": optimizer_step_counts(trainer)}


def _two_process_sources(rank, world_size, root):
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    _fit(2, "ddp", 1, callbacks=[_saver(root, "ddp")])
    for stage in (2, 3):
        _fit(2, DeepSpeedDataParallelStrategy(zero_stage=stage), 1, callbacks=[_saver(root, f"zero{stage}")])


def _resume_all(rank, world_size, root, names, dropped=(), refused=None):
    """Resume every source of the targets ``names``.

    The optimizer state is dropped for ``dropped``; ``refused``: the messages.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if world_size == 4:  # Lightning's ModelParallelStrategy dp2 x tp2 folder, for the pp2 target
        mp = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        _fit(4, mp, 1, data_parallel=2, module=TensorAndFullyShardedMLP(optimizer="adamw"),
             callbacks=[_saver(root, "model_parallel")])
    out = {}
    for name in names:
        _, sizes, sources = TARGETS[name]
        for source in sources:
            losses, trainer = _fit(world_size, Hybrid(**sizes), 2, ckpt_path=str(Path(root) / f"{source}.ckpt"), seed=1)
            out[(name, source)] = {"losses": losses, "steps": optimizer_step_counts(trainer)}
    for name, source in dropped:
        losses, _ = _fit(world_size, Hybrid(load_optimizer_state=False, **TARGETS[name][1]), 2,
                         ckpt_path=str(Path(root) / f"{source}.ckpt"), seed=1)
        out[(name, source, "dropped")] = {"losses": losses}
    if refused:
        out["refused"] = _refusals(rank, world_size, refused)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    (reference,) = run_processes(_single_process, 1, str(root), timeout=600)
    run_processes(_two_process_sources, 2, str(root), timeout=900)
    return root, reference


@pytest.fixture(scope="module")
def resumed(sources):
    root, _ = sources
    four = [n for n, (world, _, _) in TARGETS.items() if world == 4]
    two = [n for n, (world, _, _) in TARGETS.items() if world == 2]
    results = run_processes(_resume_all, 4, str(root), four, timeout=1200)
    results += run_processes(
        _resume_all, 2, str(root), two, [("tp2", "ddp")], _unreadable_checkpoints(root), timeout=900
    )
    return results


def test_foreign_checkpoints_resume_with_the_losses_of_one_process(sources, resumed):
    _, reference = sources
    expected = reference["losses"]  # the resumed epoch only
    assert len(expected) == BATCHES and reference["steps"] == [2 * BATCHES]
    seen = set()
    for rank_result in resumed:
        for key, result in rank_result.items():
            if key == "refused" or len(key) == 3:
                continue
            seen.add(key)
            diff = max_abs_difference(result["losses"], expected)
            print(f"{key[1]} -> {key[0]}: max |loss difference| {diff:.2e}, optimizer steps {result['steps']}")
            assert len(result["losses"]) == BATCHES and diff < TOLERANCE, f"{key[1]} -> {key[0]}: {diff:.2e}"
            assert result["steps"] == reference["steps"], f"{key[1]} -> {key[0]}: optimizer steps {result['steps']}"
    assert seen == {(name, source) for name, (_, _, srcs) in TARGETS.items() for source in srcs}


def test_resuming_without_the_optimizer_state_visibly_changes_the_losses(sources, resumed):
    _, reference = sources
    dropped = resumed[-1][("tp2", "ddp", "dropped")]["losses"]
    print(f"optimizer state dropped: max |loss difference| {max_abs_difference(dropped, reference['losses']):.2e}")
    assert max_abs_difference(dropped, reference["losses"]) > 1e-3


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_parallel_pwned_foreign",))


def _refusals(rank, world_size, paths):
    messages = {}
    for name, path in paths.items():
        try:
            _fit(world_size, Hybrid(pipeline_parallel_size=2, data_parallel_size=1), 2, ckpt_path=path, seed=1)
            messages[name] = None
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def _unreadable_checkpoints(root: Path) -> dict[str, str]:
    """A truncated and a tampered Lightning file, a plain state dict, and a DeepSpeed folder stripped of its tag."""
    bad = root / "unreadable"
    bad.mkdir()
    data = (root / "single.ckpt").read_bytes()
    (bad / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    good = torch.load(root / "single.ckpt", weights_only=True)
    torch.save({**good, "callbacks": _Payload()}, bad / "tampered.ckpt")
    torch.save(good["state_dict"], bad / "plain.pt")
    shutil.copytree(root / "zero2.ckpt", bad / "no_latest.ckpt")
    shutil.rmtree(bad / "no_latest.ckpt" / "checkpoint")
    (bad / "no_latest.ckpt" / "latest").unlink()
    files = [("truncated", "truncated.ckpt"), ("tampered", "tampered.ckpt"), ("plain", "plain.pt"),
             ("no_latest", "no_latest.ckpt")]
    return {name: str(bad / file) for name, file in files}


def test_damaged_tampered_and_unknown_checkpoints_are_refused_with_the_fix(sources, resumed):
    root, _ = sources
    messages = resumed[-1]["refused"]
    assert "truncated or damaged" in messages["truncated"] and "save it again" in messages["truncated"]
    assert "Refusing" in messages["tampered"] and "weights_only=False" in messages["tampered"]
    assert "without Lightning's entries" in messages["plain"] and "load_state_dict" in messages["plain"]
    assert "neither a DCP checkpoint" in messages["no_latest"]
    assert not any("Could not find a distributed model" in m for m in messages.values())
    assert not Path("/tmp/lightning_parallel_pwned_foreign").exists()
    with pytest.raises(pickle.UnpicklingError):  # the tampered file really holds a payload
        torch.load(root / "unreadable" / "tampered.ckpt", weights_only=True)
