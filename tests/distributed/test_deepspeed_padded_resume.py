"""A DeepSpeed ZeRO checkpoint with padded param groups resumes under data 2 x tensor 2, SGD momentum included.

ZeRO 1/2 pad each param group's flat buffer to a multiple of 2 x the data-parallel size and save the last
rank's fp32 partition without the padding but the optimizer state (SGD's ``momentum_buffer``, AdamW's
moments) with it. The residual MLP here (hidden width 62, 3 blocks: 14,490 parameters) leaves 2 elements of
padding at data 2, which the reader once refused ("'momentum_buffer' is neither laid out like the flat fp32
partition nor a scalar"). DeepSpeed trains 1 epoch on 2 processes and checkpoints; the hybrid strategy resumes
the folder on 4 processes as data 2 x tensor 2 (hidden 62 splits 31 + 31) and must see the losses of the
uninterrupted 2-epoch DeepSpeed run, on every rank; the consolidated optimizer state must equal DeepSpeed's own
live, gathered state. Negative control: the same resume without the optimizer state visibly differs.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_parallel import checkpoints
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_regression_epochs
from lightning_parallel.testing.models import ResidualMLP
from tests.distributed.test_deepspeed_to_dcp import STATE_KEYS, _live_optimizer_state

# The resume loads the converted folder through DCP with a process group per run; DCP warns on the main process.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

BATCHES = 4  # per epoch; DeepSpeed checkpoints at the end of epoch 0, the hybrid strategy resumes epoch 1
GLOBAL_BATCH = 16
HIDDEN, DEPTH = 62, 3  # 14,490 parameters: not a multiple of 4 (2 x data 2), so ZeRO 1/2 pad the group by 2
# (ZeRO stage, optimizer): SGD with momentum 0.9 at stage 2 is the case of record; stage 1 shares its format,
# stage 3 pads per parameter and saves the padding with the weights; AdamW had the same failure.
CASES = [(2, "sgd"), (1, "sgd"), (3, "sgd"), (2, "adamw")]
TOLERANCE = 1e-5

_fit = partial(fit_regression_epochs, batches=BATCHES, global_batch=GLOBAL_BATCH)


def _module(optimizer: str, seed: int = 0) -> ResidualMLP:
    return ResidualMLP(hidden=HIDDEN, depth=DEPTH, optimizer=optimizer, seed=seed)


def _name(stage: int, optimizer: str) -> str:
    return f"zero{stage}_{optimizer}"


def _deepspeed_runs(rank: int, world_size: int, root: str) -> dict:
    """Per case: the uninterrupted 2-epoch losses, the 1-epoch run that checkpoints, and its live optimizer state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    out = {}
    for stage, optimizer in CASES:
        full, _ = _fit(world_size, DeepSpeedDataParallelStrategy(zero_stage=stage), 2, module=_module(optimizer))
        saver = ModelCheckpoint(dirpath=root, filename=_name(stage, optimizer), save_top_k=-1, every_n_epochs=1,
                                save_on_train_epoch_end=True)
        first, trainer = _fit(world_size, DeepSpeedDataParallelStrategy(zero_stage=stage), 1,
                              module=_module(optimizer), callbacks=[saver])
        out[(stage, optimizer)] = {"full": full, "first": first,
                                   "live": _live_optimizer_state(trainer, STATE_KEYS[optimizer])}
    return out


def _resume_data2_tensor2(rank: int, world_size: int, root: str) -> dict:
    """Every case's folder resumed as data 2 x tensor 2 (module seed 1: weights not loaded would show); and
    ZeRO-2 SGD once more without its optimizer state (the negative control)."""
    from lightning_parallel.strategies import HybridParallelStrategy

    def resume(stage: int, optimizer: str, **kwargs) -> list[float]:
        strategy = HybridParallelStrategy(tensor_parallel_size=2, **kwargs)
        path = str(Path(root) / f"{_name(stage, optimizer)}.ckpt")
        return _fit(world_size, strategy, 2, module=_module(optimizer, seed=1), ckpt_path=path)[0]

    out: dict = {case: resume(*case) for case in CASES}
    with warnings.catch_warnings():  # said on rank 0 only: what was dropped
        warnings.filterwarnings("ignore", message=".*optimizer state .* was dropped")
        out["zero2_sgd_without_optimizer_state"] = resume(2, "sgd", load_optimizer_state=False)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_padded")
    return {"root": root, "runs": run_processes(_deepspeed_runs, 2, str(root), timeout=600)}


@pytest.fixture(scope="module")
def resumed(trained) -> list[dict]:
    return run_processes(_resume_data2_tensor2, 4, str(trained["root"]), timeout=600)


def _uninterrupted(trained, stage: int, optimizer: str, rank: int) -> list[float]:
    run = trained["runs"][rank][(stage, optimizer)]
    assert max_abs_difference(run["first"], run["full"][:BATCHES]) < 1e-6  # the checkpointed run is the same run
    assert run["full"][-1] < run["full"][0]  # it trained
    return run["full"][BATCHES:]


@pytest.mark.parametrize("stage", (1, 2))
def test_deepspeed_padded_the_group_on_the_last_rank(trained, stage):
    """The precondition: the optimizer state of the last rank is longer than its saved fp32 partition."""
    shard = torch.load(trained["root"] / f"{_name(stage, 'sgd')}.ckpt" / "checkpoint" /
                       "zero_pp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
    assert shard["group_paddings"] == [2]
    momentum = shard["base_optimizer_state"]["state"][0]["momentum_buffer"]
    assert momentum.numel() == shard["single_partition_of_fp32_groups"][0].numel() + 2


@pytest.mark.parametrize("stage, optimizer", CASES)
def test_consolidated_optimizer_state_equals_deepspeeds_own(trained, stage, optimizer):
    live = trained["runs"][0][(stage, optimizer)]["live"]
    state = checkpoints.consolidate_optimizer_state(trained["root"] / f"{_name(stage, optimizer)}.ckpt")["state"]
    assert state.keys() == live.keys()
    for name, per_key in live.items():
        for key, value in per_key.items():
            torch.testing.assert_close(state[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")


@pytest.mark.parametrize("stage, optimizer", CASES)
def test_resumed_as_data2_tensor2_like_the_uninterrupted_deepspeed_run(trained, resumed, stage, optimizer):
    for deepspeed_rank in range(2):
        reference = _uninterrupted(trained, stage, optimizer, deepspeed_rank)
        for rank, losses in enumerate(resumed):
            diff = max_abs_difference(losses[(stage, optimizer)], reference)
            assert diff < TOLERANCE, f"ZeRO-{stage} {optimizer} resumed under dp2 x tp2, rank {rank}: {diff:.2e}"


def test_without_the_momentum_the_losses_differ(trained, resumed):
    """Negative control: the parity above can fail, and does when SGD's momentum is not carried."""
    reference = _uninterrupted(trained, 2, "sgd", 0)
    for losses in resumed:
        assert max_abs_difference(losses[(2, "sgd")], reference) < TOLERANCE
        assert max_abs_difference(losses["zero2_sgd_without_optimizer_state"], reference) > 1e-3
