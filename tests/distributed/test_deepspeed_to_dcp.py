"""A DeepSpeed ZeRO checkpoint converted to the suite's DCP folder resumes under other layouts.

DeepSpeed trains 1 epoch (4 AdamW steps) on 2 processes and checkpoints at the epoch end;
the folder is converted on this (single, process-group-free) process; the suite's strategies
resume it for a second epoch -- on 1 process and as a 2-stage pipeline -- and must see the
losses of the uninterrupted 2-epoch DeepSpeed run, on every rank. The converted optimizer
state must equal DeepSpeed's own live, gathered state; a conversion that resets the
optimizer must visibly change the losses (the negative control).

Process starts dominate the cost on this 2-core machine, so each launch runs several fits
(module-scoped fixtures) and the tests only compare numbers.
"""

from __future__ import annotations

import shutil
import time
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel import checkpoints
from lightning_parallel.cli import convert
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_regression_epochs
from lightning_parallel.testing.models import ResidualMLP

# The converted folder is read on this process without a process group, as intended; DCP warns about it.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

BATCHES = 4  # per epoch; DeepSpeed checkpoints at the end of epoch 0, the suite resumes epoch 1
GLOBAL_BATCH = 16
# (ZeRO stage, optimizer) trained under DeepSpeed on 2 processes. 2 and 3 with AdamW are the
# cases of record; stage 1 with SGD covers momentum_buffer, stage 0 the unsharded format.
CASES = [(2, "adamw"), (3, "adamw"), (1, "sgd"), (0, "adamw")]
PIPELINE_CASES = [(2, "adamw"), (3, "adamw")]
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
TOLERANCE = 1e-5


def _name(stage: int, optimizer: str) -> str:
    return f"zero{stage}_{optimizer}"


# Resumes pass seed=1: weights that do not come from the checkpoint would show up as a loss gap.
_fit = partial(fit_regression_epochs, batches=BATCHES, global_batch=GLOBAL_BATCH)


def _live_optimizer_state(trainer: pl.Trainer, keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own view of the full optimizer state per parameter (a collective under ZeRO 1-3)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    out = {}
    for name, param in trainer.lightning_module.named_parameters():
        gathered = {key: safe_get_full_optimizer_state(param, key) for key in keys}
        if any(value is None for value in gathered.values()):  # stage 0: the torch optimizer holds it whole
            gathered = {key: trainer.optimizers[0].state[param][key] for key in keys}
        out[name] = {key: value.detach().cpu().clone() for key, value in gathered.items()}
    return out


def _deepspeed_runs(rank: int, world_size: int, root: str) -> dict:
    """Per case: the uninterrupted 2-epoch losses, the 1-epoch run that checkpoints, and its live optimizer state."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    out = {}
    for stage, optimizer in CASES:
        full, _ = _fit(world_size, DeepSpeedDataParallelStrategy(zero_stage=stage), 2, optimizer=optimizer)
        saver = ModelCheckpoint(dirpath=root, filename=_name(stage, optimizer), save_top_k=-1, every_n_epochs=1,
                                save_on_train_epoch_end=True)
        first, trainer = _fit(world_size, DeepSpeedDataParallelStrategy(zero_stage=stage), 1, optimizer=optimizer,
                              callbacks=[saver])
        live = _live_optimizer_state(trainer, STATE_KEYS[optimizer])
        out[(stage, optimizer)] = {"full": full, "first": first, "live": live}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """DeepSpeed runs (2 processes) and their epoch-0 checkpoints converted to DCP folders here, on one process."""
    root = tmp_path_factory.mktemp("ds_to_dcp")
    per_rank = run_processes(_deepspeed_runs, 2, str(root), timeout=600)
    seconds = {}
    for stage, optimizer in CASES:
        source = root / f"{_name(stage, optimizer)}.ckpt"
        start = time.perf_counter()
        checkpoints.convert_to_dcp(source, root / f"{_name(stage, optimizer)}.dcp")
        seconds[(stage, optimizer)] = time.perf_counter() - start
    checkpoints.convert_to_dcp(root / "zero2_adamw.ckpt", root / "zero2_adamw_reset.dcp", optimizer_state=False)
    return {"root": root, "runs": per_rank, "seconds": seconds}


def _resume_single(
    rank: int, world_size: int, root: str, names: list[tuple[str, str]]
) -> dict[str, list[float]]:
    from lightning_parallel.strategies import HybridParallelStrategy

    return {
        folder: _fit(1, HybridParallelStrategy(), 2, optimizer=optimizer, ckpt_path=str(Path(root) / folder), seed=1)[0]
        for folder, optimizer in names
    }


def _resume_pipeline(rank: int, world_size: int, root: str, names: list[tuple[str, str]]) -> dict[str, list[float]]:
    from lightning_parallel.strategies.hybrid.presets import PipelineParallelStrategy

    return {folder: _fit(world_size, PipelineParallelStrategy(pipeline_parallel_size=2), 2, optimizer=optimizer,
                         ckpt_path=str(Path(root) / folder), seed=1)[0]
            for folder, optimizer in names}


@pytest.fixture(scope="module")
def single_process(trained):
    names = [(f"{_name(s, o)}.dcp", o) for s, o in CASES] + [("zero2_adamw_reset.dcp", "adamw")]
    return run_processes(_resume_single, 1, str(trained["root"]), names, timeout=600)[0]


@pytest.fixture(scope="module")
def pipeline(trained):
    names = [(f"{_name(s, o)}.dcp", o) for s, o in PIPELINE_CASES]
    return run_processes(_resume_pipeline, 2, str(trained["root"]), names, timeout=600)


def _uninterrupted(trained, stage: int, optimizer: str, rank: int = 0) -> list[float]:
    run = trained["runs"][rank][(stage, optimizer)]
    assert max_abs_difference(run["first"], run["full"][:BATCHES]) < 1e-6  # the checkpointed run is the same run
    assert run["full"][-1] < run["full"][0]  # it trained
    return run["full"][BATCHES:]


@pytest.mark.parametrize("stage, optimizer", CASES)
def test_resumed_on_one_process_like_the_uninterrupted_deepspeed_run(trained, single_process, stage, optimizer):
    losses = single_process[f"{_name(stage, optimizer)}.dcp"]
    for rank in range(2):
        diff = max_abs_difference(losses, _uninterrupted(trained, stage, optimizer, rank))
        assert diff < TOLERANCE, f"ZeRO-{stage} {optimizer} (DeepSpeed rank {rank}) resumed on 1 process: {diff:.2e}"


@pytest.mark.parametrize("stage, optimizer", PIPELINE_CASES)
def test_resumed_as_a_two_stage_pipeline_like_the_uninterrupted_deepspeed_run(trained, pipeline, stage, optimizer):
    reference = _uninterrupted(trained, stage, optimizer)
    for rank, result in enumerate(pipeline):
        diff = max_abs_difference(result[f"{_name(stage, optimizer)}.dcp"], reference)
        assert diff < TOLERANCE, f"ZeRO-{stage} {optimizer} resumed under pp2, rank {rank}: {diff:.2e}"


def test_without_the_optimizer_state_the_losses_differ(trained, single_process):
    """Negative control: the parity above can fail, and does when the optimizer state is not carried."""
    reference = _uninterrupted(trained, 2, "adamw")
    assert max_abs_difference(single_process["zero2_adamw.dcp"], reference) < TOLERANCE
    assert max_abs_difference(single_process["zero2_adamw_reset.dcp"], reference) > 1e-3


def _load_converted(path: Path, optimizer: str) -> tuple[ResidualMLP, torch.optim.Optimizer, dict]:
    """The converted folder loaded through the suite's own loader, on this process (no process group)."""
    module = ResidualMLP(optimizer=optimizer, seed=1)
    optim = module.configure_optimizers()
    meta = checkpoints.load_sharded_checkpoint(path, module, [optim])
    return module, optim, meta


@pytest.mark.parametrize("stage, optimizer", CASES)
def test_converted_optimizer_state_equals_deepspeeds_own(trained, stage, optimizer):
    live = trained["runs"][0][(stage, optimizer)]["live"]
    module, optim, _ = _load_converted(trained["root"] / f"{_name(stage, optimizer)}.dcp", optimizer)
    worst = 0.0
    for name, param in module.named_parameters():
        for key in STATE_KEYS[optimizer]:
            worst = max(worst, float((optim.state[param][key] - live[name][key]).abs().max()))
        if optimizer == "adamw":
            assert float(optim.state[param]["step"]) == BATCHES
    assert worst == 0.0, f"ZeRO-{stage} {optimizer}: converted optimizer state differs by {worst:.2e}"
    # The weights too: the plain consolidation and the DCP folder agree bit for bit.
    plain = checkpoints.consolidate_state_dict(trained["root"] / f"{_name(stage, optimizer)}.ckpt")
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, plain[name], rtol=0, atol=0)


def test_lightning_state_is_carried_and_the_source_recorded(trained):
    source = checkpoints.read_lightning_state(trained["root"] / "zero3_adamw.ckpt")
    _, _, meta = _load_converted(trained["root"] / "zero3_adamw.dcp", "adamw")
    assert (meta["epoch"], meta["global_step"]) == (source["epoch"], source["global_step"]) == (0, BATCHES)
    assert meta["loops"] == source["loops"] and meta["callbacks"] == source["callbacks"]
    assert not {"module", "optimizer", "ds_config", "param_shapes"} & meta.keys()  # DeepSpeed's own keys stay behind
    assert meta["lightning_parallel"]["source"].endswith("ZeRO-3") and meta["lightning_parallel"]["layout"] == (2, 1, 1)
    assert not list(trained["root"].glob(".*.partial"))  # written to a hidden name, then renamed


def test_the_command_writes_either_format(trained, tmp_path, capsys):
    source = str(trained["root"] / "zero2_adamw.ckpt")
    assert convert.main([source, str(tmp_path / "out.ckpt")]) == 0
    assert "wrote DCP checkpoint" in capsys.readouterr().out
    assert checkpoints.is_sharded_checkpoint(tmp_path / "out.ckpt")
    assert convert.main([source, str(tmp_path / "weights.pt")]) == 0
    plain = torch.load(tmp_path / "weights.pt", weights_only=True)
    ResidualMLP().load_state_dict(plain)  # strict
    assert convert.main([source, str(tmp_path / "forced"), "--to", "pt"]) == 0 and (tmp_path / "forced").is_file()
    assert convert.main([str(tmp_path / "missing"), str(tmp_path / "x.ckpt")]) == 2
    assert "not a DeepSpeed checkpoint folder" in capsys.readouterr().err


def test_a_folder_that_is_not_deepspeeds_is_refused(trained, tmp_path):
    with pytest.raises(ValueError, match="no 'latest' file"):
        checkpoints.convert_to_dcp(trained["root"] / "zero2_adamw.dcp", tmp_path / "again.ckpt")  # already converted
    with pytest.raises(ValueError, match="not a DeepSpeed checkpoint folder"):
        checkpoints.convert_to_dcp(tmp_path / "nothing", tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()


def _edit(folder: Path, pattern: str, change) -> None:
    for file in folder.glob(f"checkpoint/{pattern}"):
        state = torch.load(file, weights_only=False)
        change(state)
        torch.save(state, file)


def test_optimizer_state_that_cannot_be_resplit_is_refused(trained, tmp_path):
    """A factored second moment (Adafactor-like: one value per row, not per element) has no per-parameter split."""
    folder = tmp_path / "factored.ckpt"
    shutil.copytree(trained["root"] / "zero2_adamw.ckpt", folder)

    def factor(state):
        group_state = state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        group_state["exp_avg_sq"] = group_state["exp_avg_sq"][:32].clone()

    _edit(folder, "*_optim_states.pt", factor)
    with pytest.raises(ValueError, match="'exp_avg_sq' is neither laid out like the flat fp32 partition"):
        checkpoints.convert_to_dcp(folder, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / ".out.ckpt.partial").exists()


def test_a_deepspeed_checkpoint_not_written_by_lightning_is_refused(trained, tmp_path):
    folder = tmp_path / "engine_only.ckpt"
    shutil.copytree(trained["root"] / "zero2_adamw.ckpt", folder)
    _edit(folder, "*model_states.pt", lambda state: state.pop("loops"))
    with pytest.raises(ValueError, match="not written by trainer.save_checkpoint"):
        checkpoints.convert_to_dcp(folder, tmp_path / "out.ckpt")
    checkpoints.convert_checkpoint(folder, tmp_path / "weights.pt")  # the weights still convert


def test_conversion_figures(trained, single_process, pipeline, record_property):
    """Not a check: the measured numbers, printed with -s and kept in the junit report."""
    root = trained["root"]

    def size(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    for (stage, optimizer), seconds in trained["seconds"].items():
        name = _name(stage, optimizer)
        line = (f"{name}: convert {seconds:.2f}s, DeepSpeed {size(root / f'{name}.ckpt') / 1024:.0f} KiB -> "
                f"DCP {size(root / f'{name}.dcp') / 1024:.0f} KiB, resumed max |loss diff| 1 proc "
                f"{max_abs_difference(single_process[f'{name}.dcp'], _uninterrupted(trained, stage, optimizer)):.1e}")
        if (stage, optimizer) in PIPELINE_CASES:
            pp = max(max_abs_difference(r[f"{name}.dcp"], _uninterrupted(trained, stage, optimizer)) for r in pipeline)
            line += f", pp2 {pp:.1e}"
        print(line)
        record_property(name, line)
    reset = max_abs_difference(single_process["zero2_adamw_reset.dcp"], _uninterrupted(trained, 2, "adamw"))
    print(f"zero2_adamw converted without optimizer state (negative control): max |loss diff| {reset:.1e}")
    record_property("negative_control", reset)
