"""Under DeepSpeed ZeRO-3 a model built in ``configure_model`` is partitioned as it is constructed (``zero.Init``).

Lightning's ``DeepSpeedStrategy.model_sharded_context`` wraps ``configure_model`` in ``deepspeed.zero.Init``
(with the strategy's config) at stage 3; :class:`DeepSpeedDataParallelStrategy` keeps it, and on CPU too:
DeepSpeed's accelerator is switched to CPU in ``setup_environment``, before ``configure_model``. zero.Init
lets each module's ``__init__`` run at full size (``reset_parameters`` draws from the random stream exactly
as without it), then broadcasts rank 0's values and keeps this rank's partition. So on 2 processes:

- right after construction, inside ``configure_model``, every parameter is already partitioned: no storage of
  its own (``numel() == 0``), this rank's ``ds_tensor`` about half of it;
- the initial weights are rank 0's plain construction: each rank here seeds with ``SEED + rank``, yet every
  rank trains from the weights of ``ResidualMLP(seed=SEED)``;
- the losses equal one process training the same module built the same way (< 1e-5, every rank), and differ
  from one starting from rank 1's seed (the negative control).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.protocol import seeded_init
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_recording_losses
from lightning_parallel.testing.models import DeferredResidualMLP, ResidualMLP, regression_dataset
from tests.distributed.parity_runs import SAMPLES

pytestmark = pytest.mark.slow

SEED = 0
GLOBAL_BATCH = 16
STEPS = 10
TOLERANCE = 1e-5


def _full_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, gathered from the ZeRO-3 partitions where there are any (all ranks must call)."""
    params = list(module.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return {name: p.detach().clone() for name, p in module.named_parameters()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


class _RecordedBuild(DeferredResidualMLP):
    """Builds in ``configure_model`` under ``SEED + global rank``; records how the parameters are held right after
    construction (``built``) and their full values when training starts (``initial``)."""

    def configure_model(self) -> None:
        if hasattr(self, "inp"):
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED + self.global_rank)
            super().configure_model()
        params = list(self.parameters())
        self.built = {
            "partitioned": [hasattr(p, "ds_id") for p in params],
            "storage": sum(p.numel() for p in params),  # a ZeRO-3 parameter's own data is an empty placeholder
            "local": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
            "full": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
            "count": len(params),
        }

    def on_train_start(self) -> None:
        self.initial = _full_weights(self)


def _fit(rank: int, world_size: int, strategy: object) -> dict:
    pl.seed_everything(SEED, verbose=False)
    module = _RecordedBuild(optimizer="sgd")
    losses = fit_recording_losses(module, strategy, world_size, regression_dataset(SAMPLES, 32),
                                  GLOBAL_BATCH // world_size, STEPS)
    return {"losses": losses, "built": module.built, "initial": module.initial}


def _zero3(rank: int, world_size: int) -> dict:
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    return _fit(rank, world_size, DeepSpeedDataParallelStrategy(zero_stage=3))


def _one_process(rank: int, world_size: int) -> dict:
    """The reference (``_RecordedBuild`` on one process: seed ``SEED``), and a run from rank 1's seed instead."""
    out = _fit(rank, world_size, "auto")
    other = ResidualMLP(optimizer="sgd", seed=SEED + 1)
    pl.seed_everything(SEED, verbose=False)
    out["other_seed"] = fit_recording_losses(other, "auto", 1, regression_dataset(SAMPLES, 32), GLOBAL_BATCH, STEPS)
    return out


@pytest.fixture(scope="module")
def zero3() -> list[dict]:
    return run_processes(_zero3, 2, timeout=600)


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_processes(_one_process, 1, timeout=600)[0]


def test_each_rank_holds_half_the_model_from_construction_on(zero3):
    for rank, result in enumerate(zero3):
        built = result["built"]
        assert all(built["partitioned"]), f"rank {rank}: a parameter was not partitioned at construction"
        assert built["storage"] == 0, f"rank {rank}: parameters kept {built['storage']} elements of full storage"
        # Each parameter's partition is ceil(numel / 2): half the model, give or take one element per parameter.
        assert abs(built["local"] - built["full"] / 2) <= built["count"], (rank, built)
    assert zero3[0]["built"]["full"] == sum(p.numel() for p in ResidualMLP().parameters())


def test_initial_weights_are_rank_zeros_plain_construction(zero3, reference):
    expected = ResidualMLP(seed=SEED).state_dict()
    for name, value in reference["initial"].items():  # one process: built plainly under SEED
        assert torch.equal(value, expected[name]), name
    for rank, result in enumerate(zero3):  # rank 1 seeded SEED + 1, yet holds rank 0's values
        for name, value in result["initial"].items():
            assert torch.equal(value, expected[name]), f"rank {rank}: {name}"


def test_losses_equal_one_process(zero3, reference):
    losses = reference["losses"]
    assert losses[-1] < losses[0]  # it trained
    for rank, result in enumerate(zero3):
        diff = max_abs_difference(result["losses"], losses)
        assert diff < TOLERANCE, f"ZeRO-3 built under zero.Init, rank {rank}: max |diff| {diff:.2e}"
        # Negative control: the comparison can fail, as it does against rank 1's own seed.
        assert max_abs_difference(result["losses"], reference["other_seed"]) > 1e-3


class _SeededBuild(DeferredResidualMLP):
    """Builds in ``configure_model`` and gives itself the suite's per-module seeded initialisation, as the recipes
    do when they are built with storage: under ZeRO-3 the parameters are already partitioned there."""

    def configure_model(self) -> None:
        if hasattr(self, "inp"):
            return
        super().configure_model()
        seeded_init(self, SEED)

    def on_train_start(self) -> None:
        self.initial = _full_weights(self)


def _seeded_zero3(rank: int, world_size: int) -> dict:
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    pl.seed_everything(SEED, verbose=False)
    module = _SeededBuild(optimizer="sgd")
    fit_recording_losses(module, DeepSpeedDataParallelStrategy(zero_stage=3), world_size,
                         regression_dataset(SAMPLES, 32), GLOBAL_BATCH // world_size, 1)
    return module.initial


def test_seeded_init_reaches_zero3_partitions_with_the_values_every_layout_starts_from():
    expected = ResidualMLP()
    seeded_init(expected, SEED)  # what the suite's layouts materialise a meta-built model to
    for rank, initial in enumerate(run_processes(_seeded_zero3, 2, timeout=600)):
        for name, value in expected.state_dict().items():
            assert torch.equal(initial[name], value), f"rank {rank}: {name}"
