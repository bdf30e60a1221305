"""Suite checkpoints (dp2 x tp2, pp2 x tp2) -> ``lp-convert --to lightning`` -> Lightning's own ``auto`` and ``ddp``
strategies resume them with the losses and optimizer step counts of the uninterrupted single-process run."""

import time
from pathlib import Path

import pytest

from lightning_parallel.cli.convert import main as lp_convert
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import optimizer_step_counts
from tests.distributed.saved_checkpoints import BATCHES, fit

pytestmark = pytest.mark.slow

CONVERTED = ("dp2xtp2", "pp2xtp2")  # of the session's suite checkpoints (saved_checkpoints.py)


def _fit(world_size, strategy, epochs, ckpt_path=None, seed=0):
    losses, trainer = fit(world_size, strategy, epochs, ckpt_path=ckpt_path, seed=seed)
    return losses, optimizer_step_counts(trainer)


def _resume_all(rank, world_size, root, strategy, reference):
    out = {name: _fit(world_size, strategy, 2, ckpt_path=str(Path(root) / f"{name}.lightning.ckpt"), seed=1)
           for name in CONVERTED}
    if reference:
        out["reference"] = _fit(world_size, strategy, 2)
    return out


def test_suite_checkpoints_converted_to_lightning_resume_under_auto_and_ddp_exactly(
    hybrid_checkpoints, tmp_path, capsys
):
    for name in CONVERTED:
        start = time.perf_counter()
        converted = str(tmp_path / f"{name}.lightning.ckpt")
        assert lp_convert([str(hybrid_checkpoints / f"{name}.ckpt"), converted, "--to", "lightning"]) == 0
        print(f"{name}: converted in {time.perf_counter() - start:.2f}s")
    (single,) = run_processes(_resume_all, 1, str(tmp_path), "auto", True, timeout=900)
    reference_losses, reference_steps = single.pop("reference")
    assert reference_steps == [2 * BATCHES]
    ddp = run_processes(_resume_all, 2, str(tmp_path), "ddp", False, timeout=900)
    for target, results in (("auto", [single]), ("ddp", ddp)):
        for rank, result in enumerate(results):
            for source, (losses, steps) in result.items():
                assert len(losses) == BATCHES and steps == reference_steps
                diff = max_abs_difference(losses, reference_losses[BATCHES:])
                print(f"{source} -> lightning -> {target} rank {rank}: max |loss diff| {diff:.2e}, steps {steps}")
                assert diff < 1e-5, f"{source} -> {target} rank {rank}: {diff:.2e}"
