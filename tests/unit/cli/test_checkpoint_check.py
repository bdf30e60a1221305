"""The start checkpoint read before any process starts: readable, of this model (cli/checkpoint_check.py)."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lightning_parallel.cli.checkpoint_check import check_resume_checkpoint, model_difference


def _lightning_file(path, module):
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 3, "state_dict": module.state_dict()}, path)
    return path


def _cfg(path):
    return OmegaConf.create({"ckpt_path": str(path), "resume": None})


def test_the_same_model_passes(tmp_path):
    path = _lightning_file(tmp_path / "last.ckpt", nn.Linear(4, 2))
    check_resume_checkpoint(_cfg(path), path, nn.Linear(4, 2))


def test_a_truncated_file_is_named_as_such_with_the_users_setting(tmp_path):
    path = _lightning_file(tmp_path / "last.ckpt", nn.Linear(64, 64))
    data = path.read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"^ckpt_path={cut}: .*truncated or damaged"):
        check_resume_checkpoint(_cfg(cut), cut, nn.Linear(64, 64))


def test_a_file_that_is_no_checkpoint_says_what_it_looks_like(tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="is not a checkpoint a run can resume from; it looks like a file that is"):
        check_resume_checkpoint(_cfg(path), path, nn.Linear(4, 2))


def test_another_models_checkpoint_is_named_as_another_model_with_the_writers_choice(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- model=gpt_tiny\n- trainer.max_steps=2\n")
    (run / "checkpoints").mkdir()
    path = _lightning_file(run / "checkpoints" / "last.ckpt", nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    with pytest.raises(ValueError) as caught:
        check_resume_checkpoint(_cfg(path), path, nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 2)))
    message = str(caught.value)
    assert message.startswith(f"ckpt_path={path} holds another model than this run's Sequential: 3 of 4 tensors")
    assert "0.weight: [8, 4] in the checkpoint, [16, 4] in this model" in message
    assert "(the run that wrote it chose: model=gpt_tiny)" in message and "leave ckpt_path out" in message
    assert "load_optimizer_state" not in message  # the advice that led into a second error


def test_a_model_the_meta_device_cannot_build_is_not_compared(tmp_path):
    path = _lightning_file(tmp_path / "last.ckpt", nn.Linear(4, 2))
    check_resume_checkpoint(_cfg(path), path, None)


def test_the_difference_lists_a_few_names_of_each_kind_and_counts_the_rest():
    stored = {f"w{i}": (2,) for i in range(10)}
    model = {f"w{i}": (3,) for i in range(6)} | {"extra": (1,)}
    text = model_difference(stored, model)
    assert text.startswith("6 of 7 tensors have another shape (w0: [2] in the checkpoint, [3] in this model; w1, w2, "
                           "w3 and 2 more)")
    assert "1 of this model's tensors are not in it (extra)" in text
    assert "it holds 4 this model lacks (w6, w7, w8 and 1 more)" in text
    assert model_difference(stored, {"w0": (2,)}) is None  # extra stored tensors alone: not refused
