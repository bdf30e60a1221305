"""DeepSpeed ZeRO 1-3 on 2 gloo processes: same losses as 1 process, exact resume, consolidated weights.

Process starts dominate the cost on this 2-core machine, so each launch runs several fits
one after another (module-scoped fixtures) and the tests only compare the numbers.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset
from tests.distributed.parity_runs import SAMPLES, fit_losses

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 16
STAGES = (1, 2, 3)
OPTIMIZERS = ("sgd", "adamw")
CLIP = {"gradient_clip_val": 0.05}
ACCUMULATE = {"accumulate_grad_batches": 2}
# (name, optimizer, trainer_kwargs): one single-process reference per name.
REFERENCE_CASES = {
    "sgd": ("sgd", {}),
    "adamw": ("adamw", {}),
    "sgd_clip": ("sgd", CLIP),
    "sgd_accumulate": ("sgd", ACCUMULATE),
}
# (stage, reference name) pairs run under DeepSpeed on 2 processes.
DEEPSPEED_CASES = [(stage, name) for stage in STAGES for name in OPTIMIZERS] + [
    (0, "sgd"),
    (2, "sgd_clip"),
    (3, "sgd_clip"),
    (2, "sgd_accumulate"),
    (3, "sgd_accumulate"),
]
RESUME_STAGES = (2, 3)
BATCHES_PER_EPOCH = 4  # the resumed run starts at step 4 (an epoch boundary, see _resume_run)


def _fit_cases(rank: int, world_size: int, cases: list[tuple[object, str]]) -> list[list[float]]:
    """Run each (stage or None for the reference, reference name) case in this launch, in order."""
    out = []
    for stage, name in cases:
        optimizer, trainer_kwargs = REFERENCE_CASES[name]
        strategy = "auto" if stage is None else partial(DeepSpeedDataParallelStrategy, zero_stage=stage)
        data_parallel = 1 if stage is None else world_size
        out.append(fit_losses(rank, world_size, strategy, GLOBAL_BATCH, data_parallel, optimizer=optimizer,
                              trainer_kwargs=trainer_kwargs))
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    losses = run_processes(_fit_cases, 1, [(None, name) for name in REFERENCE_CASES])[0]
    return dict(zip(REFERENCE_CASES, losses))


@pytest.fixture(scope="module")
def deepspeed_losses() -> list[dict[tuple[int, str], list[float]]]:
    per_rank = run_processes(_fit_cases, 2, DEEPSPEED_CASES)
    return [dict(zip(DEEPSPEED_CASES, losses)) for losses in per_rank]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_processes_match_one_process(references, deepspeed_losses, stage, optimizer):
    reference = references[optimizer]
    assert reference[-1] < reference[0]  # it trained
    for rank, losses in enumerate(deepspeed_losses):
        diff = max_abs_difference(losses[(stage, optimizer)], reference)
        assert diff < 1e-5, f"ZeRO-{stage} {optimizer} rank {rank}: max |diff| {diff:.2e}"


def test_stage_zero_is_plain_data_parallel(references, deepspeed_losses):
    for losses in deepspeed_losses:
        assert max_abs_difference(losses[(0, "sgd")], references["sgd"]) < 1e-5


@pytest.mark.parametrize("stage", (2, 3))
def test_trainer_clipping_reaches_deepspeed(references, deepspeed_losses, stage):
    for losses in deepspeed_losses:
        assert max_abs_difference(losses[(stage, "sgd_clip")], references["sgd_clip"]) < 1e-5
        # Negative control: the clipped run really differs from the unclipped one, so the
        # comparison can fail (and DeepSpeed's own default clipping of 1.0 is not in play).
        assert max_abs_difference(losses[(stage, "sgd_clip")][:10], references["sgd"]) > 1e-3


@pytest.mark.parametrize("stage", (2, 3))
def test_gradient_accumulation_matches_one_process(references, deepspeed_losses, stage):
    for losses in deepspeed_losses:
        assert max_abs_difference(losses[(stage, "sgd_accumulate")], references["sgd_accumulate"]) < 1e-5


def _trainer(world_size: int, stage: int, history: LossHistory, max_epochs: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DeepSpeedDataParallelStrategy(zero_stage=stage),
        max_epochs=max_epochs,
        limit_train_batches=BATCHES_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[history, *callbacks],
    )


def _full_weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Every parameter in full, gathered from the ZeRO-3 shards where needed (all ranks must call)."""
    import deepspeed

    module = trainer.lightning_module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


def _resume_run(rank: int, world_size: int, stage: int, root: str) -> dict[str, object]:
    """Uninterrupted 2 epochs vs. 1 epoch + checkpoint + resume; then consolidate the final checkpoint.

    Note:
        The checkpoint is written by ModelCheckpoint at the end of epoch 0. Mid-epoch and
        the other epoch-end checkpoints resume exactly with the suite's resumable loader and
        ExactDataResume (tests/distributed/callbacks/test_exact_resume.py).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = lambda: FixedOrderData(regression_dataset(SAMPLES, 32), batch_size=GLOBAL_BATCH // world_size)  # noqa: E731
    pl.seed_everything(0)
    full = LossHistory()
    trainer = _trainer(world_size, stage, full, 2, [])
    trainer.fit(ResidualMLP(optimizer="adamw"), datamodule=data())
    full_weights = _full_weights(trainer)

    pl.seed_everything(0)
    first = LossHistory()
    saver = ModelCheckpoint(
        dirpath=root, filename="epoch0", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
    )
    trainer = _trainer(world_size, stage, first, 1, [saver])
    trainer.fit(ResidualMLP(optimizer="adamw"), datamodule=data())

    pl.seed_everything(0)
    resumed = LossHistory()
    trainer = _trainer(world_size, stage, resumed, 2, [])
    trainer.fit(ResidualMLP(optimizer="adamw", seed=1), datamodule=data(), ckpt_path=str(Path(root) / "epoch0.ckpt"))
    resumed_weights = _full_weights(trainer)

    final = str(Path(root) / "final.ckpt")
    trainer.save_checkpoint(final)
    trainer.strategy.barrier()
    result: dict[str, object] = {
        "full": full.losses,
        "first": first.losses,
        "resumed": resumed.losses,
        "weights_diff": max(float((full_weights[k] - resumed_weights[k]).abs().max()) for k in full_weights),
    }
    if rank == 0:
        from lightning_parallel.checkpoints import convert_checkpoint

        out = convert_checkpoint(final, Path(root) / "final.pt")
        plain = torch.load(out, map_location="cpu", weights_only=True)
        fresh = ResidualMLP()
        fresh.load_state_dict(plain)  # strict: every key of the module, nothing else
        result["converted_diff"] = max(float((plain[k] - resumed_weights[k]).abs().max()) for k in resumed_weights)
    trainer.strategy.barrier()
    return result


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory) -> dict[int, list[dict[str, object]]]:
    root = tmp_path_factory.mktemp("deepspeed_resume")
    return {stage: run_processes(_resume_run, 2, stage, str(root / f"zero{stage}")) for stage in RESUME_STAGES}


@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_resumed_run_continues_like_an_uninterrupted_one(resume_results, stage):
    for rank, result in enumerate(resume_results[stage]):
        full, first, resumed = result["full"], result["first"], result["resumed"]
        assert len(full) == 2 * BATCHES_PER_EPOCH and len(resumed) == BATCHES_PER_EPOCH
        assert max_abs_difference(first, full[:BATCHES_PER_EPOCH]) < 1e-6
        diff = max_abs_difference(resumed, full[BATCHES_PER_EPOCH:])
        assert diff < 1e-6, f"ZeRO-{stage} rank {rank}: resumed losses differ by {diff:.2e}"
        assert result["weights_diff"] < 1e-6  # and the weights end up the same


@pytest.mark.parametrize("stage", RESUME_STAGES)
def test_checkpoint_converts_to_a_plain_state_dict(resume_results, stage):
    assert resume_results[stage][0]["converted_diff"] == 0.0
