"""A crafted checkpoint in every format the suite reads is refused through every door, its payload never run.

Each file holds an object whose ``__reduce__`` runs ``touch MARKER``: the marker must not appear, whichever reader
sees the file first (lp-convert, the resume path every suite strategy takes, lp-train's start-up step read, the
Python readers), and the error must name the opt-in where one exists (``weights_only=False`` /
``lp-convert --trust-source``). DeepSpeed folders were read with ``weights_only=False`` before (a ZeRO folder's
payload ran under ``lp-convert``); a DCP folder's ``.metadata`` and entries have no opt-in (DCP writes only its own
classes there). The suite's own checkpoints of every kind still load: the other modules of this folder, and
the real ZeRO 0-3 classes below.
"""

from __future__ import annotations

import fractions
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from lightning_parallel.checkpoints import optimizer_state_dict, save_on_one_process
from lightning_parallel.checkpoints.dcp import load_sharded_checkpoint
from lightning_parallel.checkpoints.deepspeed.convert import as_lightning_checkpoint, convert_to_dcp
from lightning_parallel.checkpoints.deepspeed.folder import (
    check_deepspeed_checkpoint,
    consolidate_state_dict,
    read_lightning_state,
)
from lightning_parallel.checkpoints.deepspeed.optimizer import consolidate_optimizer_state
from lightning_parallel.checkpoints.detect import read_lightning_checkpoint
from lightning_parallel.checkpoints.hf.load import load_hf_weights
from lightning_parallel.checkpoints.lightning.writer import to_lightning_checkpoint
from lightning_parallel.checkpoints.pt import export_state_dict
from lightning_parallel.checkpoints.resume import resume_from
from lightning_parallel.checkpoints.safe_loading import (
    CheckpointRefused,
    check_deepspeed_folder,
    load_deepspeed_file,
)
from lightning_parallel.cli.convert import main as lp_convert
from lightning_parallel.cli.run_resume import checkpoint_step
from lightning_parallel.testing.models import ResidualMLP

from .conftest import LIGHTNING_STATE, WIDTH, trained_module, write_zero0_folder

pytestmark = [pytest.mark.filterwarnings("ignore:.*(single process|torch.distributed is disabled).*"),
              pytest.mark.filterwarnings("ignore:Detected pickle protocol")]
OPT_IN = "weights_only=False"
NO_OPT_IN = "no opt-in reads it"


class _Payload:
    """Runs ``touch marker`` when unpickled by anything that calls what a pickle names."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _fresh() -> tuple[ResidualMLP, torch.optim.Optimizer]:
    module = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=7)
    return module, module.configure_optimizers()


def _single_file(root: Path, payload: Any) -> Path:
    module, optim = trained_module()
    torch.save({**LIGHTNING_STATE, "state_dict": module.state_dict(), "optimizer_states": [optim.state_dict()],
                "callbacks": payload}, root / "single.ckpt")
    return root / "single.ckpt"


def _zero0(root: Path, **planted: Any) -> Path:
    """A ZeRO-0 folder whose model-state file holds ``planted`` beside DeepSpeed's and Lightning's keys."""
    module, optim = trained_module()
    folder = write_zero0_folder(root / "zero0.ckpt", module, optim)
    file = folder / "checkpoint" / "mp_rank_00_model_states.pt"
    torch.save({**torch.load(file, weights_only=True), **planted}, file)
    return folder


def _zero2(root: Path, payload: Any) -> Path:
    """A ZeRO-2-shaped folder: clean model states, one optimizer shard holding ``payload``."""
    folder = _zero0(root)
    shard = {"optimizer_state_dict": {"zero_stage": 2, "loss_scaler": payload, "partition_count": [1]},
             "ds_config": {}, "ds_version": "0.19.8"}
    torch.save(shard, folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return folder


def _dcp(root: Path, lightning: bool) -> Path:
    """The suite's folder, or what Lightning's ModelParallelStrategy writes (nested param groups)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    module, optim = trained_module()
    optimizer = get_optimizer_state_dict(module, optim) if lightning else optimizer_state_dict(module, optim)
    return save_on_one_process(root / "dcp.ckpt", {"state_dict": module.state_dict(), "optimizer_0": optimizer},
                               dict(LIGHTNING_STATE))


def _dcp_planted(root: Path, payload: Any, lightning: bool, target: str) -> Path:
    path = _dcp(root, lightning)
    if target == ".metadata":
        with open(path / ".metadata", "wb") as f:
            pickle.dump(payload, f)
    else:
        torch.save({**torch.load(path / "meta.pt", weights_only=True), "callbacks": payload}, path / "meta.pt")
    return path


def _dcp_entry(root: Path, payload: Any) -> Path:
    """A suite folder whose param-group entry (a pickled byte entry of DCP) is the payload."""
    module, optim = trained_module()
    flat = optimizer_state_dict(module, optim)
    flat[next(key for key in flat if key.endswith(".lr"))] = payload
    return save_on_one_process(root / "dcp.ckpt", {"state_dict": module.state_dict(), "optimizer_0": flat},
                               dict(LIGHTNING_STATE))


# name -> (make the crafted checkpoint, what the refusal says: the opt-in, or that there is none)
CRAFTED = {
    "lightning_single_file": (_single_file, OPT_IN),
    "deepspeed_model_states": (lambda root, p: _zero0(root, data_sampler=p), OPT_IN),
    "deepspeed_optim_states": (_zero2, OPT_IN),
    "suite_dcp_metadata": (lambda root, p: _dcp_planted(root, p, False, ".metadata"), NO_OPT_IN),
    "suite_dcp_meta_pt": (lambda root, p: _dcp_planted(root, p, False, "meta.pt"), OPT_IN),
    "suite_dcp_entry": (_dcp_entry, "tampered with"),
    "lightning_dcp_metadata": (lambda root, p: _dcp_planted(root, p, True, ".metadata"), NO_OPT_IN),
    "lightning_dcp_meta_pt": (lambda root, p: _dcp_planted(root, p, True, "meta.pt"), OPT_IN),
}


# (crafted, --to) that never read the planted file: the suite folder's weights alone make the pt output.
READS_WEIGHTS_ONLY = {("suite_dcp_entry", "pt"), ("suite_dcp_meta_pt", "pt")}


@pytest.fixture(params=sorted(CRAFTED))
def crafted(request, tmp_path) -> tuple[Path, Path, str]:
    make, says = CRAFTED[request.param]
    marker = tmp_path / "pwned"
    return make(tmp_path, _Payload(marker)), marker, says


@pytest.mark.parametrize("name", sorted(CRAFTED))
@pytest.mark.parametrize("to", ["dcp", "lightning", "pt"])
def test_lp_convert_refuses_it_in_one_line_naming_the_opt_in(tmp_path, capsys, name, to):
    make, says = CRAFTED[name]
    path = make(tmp_path, _Payload(tmp_path / "pwned"))
    code = lp_convert([str(path), str(tmp_path / "out"), "--to", to])
    assert not (tmp_path / "pwned").exists()
    if (name, to) in READS_WEIGHTS_ONLY:
        assert code == 0
        return
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("lp-convert: error: ") and says in err, err
    assert not (tmp_path / "out").exists()


def test_the_resume_path_refuses_it(crafted):
    path, marker, says = crafted
    module, optim = _fresh()
    with pytest.raises(CheckpointRefused, match=says):
        resume_from(path, module, [optim])
    assert not marker.exists()


def test_lp_train_reads_its_step_without_running_it(crafted):
    path, marker, _ = crafted
    checkpoint_step(path)  # the start-up table's read: a number, or None for a file it cannot read safely
    assert not marker.exists()


def _load_sharded(path: Path) -> Any:
    module, optim = _fresh()
    return load_sharded_checkpoint(path, module, [optim])


# check_deepspeed_checkpoint: what DeepSpeedDataParallelStrategy checks before DeepSpeed's engine reads the folder.
_DEEPSPEED = [consolidate_state_dict, consolidate_optimizer_state, as_lightning_checkpoint, check_deepspeed_checkpoint]
_DCP = [read_lightning_checkpoint, _load_sharded, to_lightning_checkpoint]
# crafted -> the Python readers that must refuse it (each reads the planted file)
READERS = {
    "lightning_single_file": [read_lightning_checkpoint],
    "deepspeed_model_states": [*_DEEPSPEED, read_lightning_state],
    "deepspeed_optim_states": _DEEPSPEED,  # read_lightning_state reads the model states only
    "suite_dcp_metadata": [*_DCP, export_state_dict],
    "suite_dcp_meta_pt": _DCP,
    "suite_dcp_entry": _DCP,
    "lightning_dcp_metadata": [*_DCP, export_state_dict],
    "lightning_dcp_meta_pt": _DCP,
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_the_python_readers_refuse_it(tmp_path, name):
    make, says = CRAFTED[name]
    path = make(tmp_path, _Payload(tmp_path / "pwned"))
    readers = READERS[name] + ([lambda p: convert_to_dcp(p, tmp_path / "out.ckpt")] if "deepspeed" in name else [])
    for read in readers:
        with pytest.raises(CheckpointRefused, match=says):
            read(path) if read is not export_state_dict else read(path, tmp_path / "out.pt")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out.ckpt").exists()


class _CallsADcpFunction:
    """A ``.metadata`` that calls a function of torch.distributed.checkpoint on a file planted beside it."""

    def __init__(self, planted: Path) -> None:
        self.planted = planted

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        from torch.distributed.checkpoint.format_utils import torch_save_to_dcp  # torch.load(weights_only=False)

        return (torch_save_to_dcp, (str(self.planted), str(self.planted.with_suffix(".out"))))


def test_a_metadata_file_cannot_call_what_dcp_defines(tmp_path, capsys):
    """The allow-list names DCP's metadata classes: a function of DCP's modules is refused like any other."""
    path = _dcp(tmp_path, lightning=False)
    torch.save({"x": _Payload(tmp_path / "pwned")}, path / "planted.pt")
    with open(path / ".metadata", "wb") as f:
        pickle.dump(_CallsADcpFunction(path / "planted.pt"), f)
    with pytest.raises(CheckpointRefused, match="format_utils.torch_save_to_dcp"):
        _load_sharded(path)
    assert lp_convert([str(path), str(tmp_path / "out.pt")]) == 2
    assert "torch_save_to_dcp" in capsys.readouterr().err and not (tmp_path / "pwned").exists()


def test_a_hugging_face_folder_is_never_unpickled(tmp_path, capsys):
    """``pytorch_model.bin`` is a pickle: the suite reads safetensors only and says so."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_hf_weights(torch.nn.Linear(2, 2), folder)
    with pytest.raises(ValueError, match="Hugging Face model folder"):
        resume_from(folder, *_fresh()[:1], [])
    assert lp_convert([str(folder), str(tmp_path / "out.pt")]) == 2
    assert lp_convert([str(folder / "pytorch_model.bin"), str(tmp_path / "out.pt")]) == 2
    assert "Hugging Face model folder" in capsys.readouterr().err
    assert not marker.exists()


def test_a_torchrec_folder_refuses_a_planted_metadata_or_meta_file(tmp_path):
    from lightning_parallel.strategies.torchrec.checkpoint import load

    marker = tmp_path / "pwned"
    for target, says in ((".metadata", NO_OPT_IN), ("meta.pt", OPT_IN)):
        path = _dcp_planted(tmp_path / target, _Payload(marker), False, target)
        module, _ = _fresh()
        with pytest.raises(CheckpointRefused, match=says):
            load(path, module, [], None)
    assert not marker.exists()


def test_trusted_sources_load_when_the_user_opts_in(tmp_path, capsys):
    """An object beyond the allow-list (not a payload) in a DeepSpeed folder: refused, then read on request."""
    folder = _zero0(tmp_path, hyper_parameters={"ratio": fractions.Fraction(1, 3)})
    assert lp_convert([str(folder), str(tmp_path / "refused.ckpt")]) == 2
    assert "--trust-source" in capsys.readouterr().err
    assert lp_convert([str(folder), str(tmp_path / "model.pt"), "--trust-source"]) == 0
    check_deepspeed_checkpoint(folder, weights_only=False)
    check_deepspeed_checkpoint(_zero0(tmp_path / "clean"))  # the suite's own folder passes
    assert read_lightning_state(folder, weights_only=False)["hyper_parameters"]["ratio"] == fractions.Fraction(1, 3)
    module, optim = _fresh()
    resume_from(folder, module, [optim], weights_only=False)  # Trainer.fit(..., weights_only=False)
    torch.testing.assert_close(module.state_dict(), trained_module()[0].state_dict(), rtol=0, atol=0)


def test_a_trusted_single_file_resumes_with_objects_in_its_param_groups(tmp_path):
    """weights_only=False reaches the entries a single file's optimizer state is served from."""
    module, optim = trained_module()
    state = optim.state_dict()
    state["param_groups"][0]["schedule"] = fractions.Fraction(1, 3)
    torch.save({**LIGHTNING_STATE, "state_dict": module.state_dict(), "optimizer_states": [state]},
               tmp_path / "single.ckpt")
    fresh, fresh_optim = _fresh()
    fresh_optim.param_groups[0]["schedule"] = None
    with pytest.raises(CheckpointRefused, match=OPT_IN):
        resume_from(tmp_path / "single.ckpt", fresh, [fresh_optim])
    resume_from(tmp_path / "single.ckpt", fresh, [fresh_optim], weights_only=False)
    assert fresh_optim.param_groups[0]["schedule"] == fractions.Fraction(1, 3)


def test_param_group_settings_hydra_gave_as_containers_load_by_default(tmp_path):
    from omegaconf import OmegaConf

    module, optim = trained_module()
    flat = optimizer_state_dict(module, optim)
    for key in [key for key in flat if key.endswith(".betas")]:  # one entry per parameter of the group
        flat[key] = OmegaConf.create([0.9, 0.95])  # AdamW(betas=cfg.betas) keeps the ListConfig
    path = save_on_one_process(tmp_path / "dcp.ckpt", {"state_dict": module.state_dict(), "optimizer_0": flat},
                               dict(LIGHTNING_STATE))
    fresh, fresh_optim = _fresh()
    load_sharded_checkpoint(path, fresh, [fresh_optim])
    assert list(fresh_optim.param_groups[0]["betas"]) == [0.9, 0.95]


def test_the_deepspeed_classes_real_zero_folders_hold_pass_and_nothing_else(tmp_path):
    """What ZeRO 1-3 optimizer shards hold (DeepSpeed 0.19.8) loads through the allow-list; a payload does not."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    tag = tmp_path / "checkpoint"
    tag.mkdir()
    fp16 = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2,
                             consecutive_hysteresis=False)  # what an fp16 run saves as its loss scaler
    shard = {"optimizer_state_dict": {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0),
                                      "fp16_loss_scaler": fp16, "partition_count": [2],
                                      "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}]}}
    torch.save(shard, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    loaded = load_deepspeed_file(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["loss_scaler"].cur_scale == 1.0
    assert loaded["fp16_loss_scaler"].scale_window == 1000
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)
    check_deepspeed_folder(tag)
    torch.save({"evil": _Payload(tmp_path / "pwned")}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointRefused, match="zero_pp_rank_1.*--trust-source"):
        check_deepspeed_folder(tag)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("make", [_zero0, _zero2], ids=["model states", "optimizer states"])
def test_the_deepspeed_strategy_checks_a_folder_before_its_engine_unpickles_it(tmp_path, make):
    """DeepSpeed's engine reads every file with weights_only=False: the strategy vouches for the folder first."""
    pytest.importorskip("deepspeed")
    from lightning_parallel.strategies import DeepSpeedDataParallelStrategy

    marker = tmp_path / "pwned"
    folder = make(tmp_path, **({"planted": _Payload(marker)} if make is _zero0 else {"payload": _Payload(marker)}))
    with pytest.raises(CheckpointRefused, match=OPT_IN):
        DeepSpeedDataParallelStrategy(zero_stage=2).load_checkpoint(folder)
    assert not marker.exists()
