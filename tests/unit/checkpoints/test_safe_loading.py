"""Hydra's OmegaConf hyper-parameters pass the allow-list; payloads and the user's own classes do not."""

from __future__ import annotations

import enum
import fractions
import os
import pathlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.checkpoints.detect import read_lightning_checkpoint
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused, load_plain, plain_containers
from lightning_parallel.cli.convert import main

from .conftest import LIGHTNING_STATE, trained_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PWNED = Path("/tmp/lightning_parallel_pwned_omegaconf")


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


class Colour(enum.Enum):
    RED = 1


@dataclass
class Settings:
    width: int = 8


def _hydra_like() -> DictConfig:
    """What Hydra hands a module: nested containers, lists, a path, an interpolation, read-only flags."""
    root = OmegaConf.create({"model": {"moe": {"every": 2, "router": "softmax"}, "widths": [8, [4, 2]],
                                       "data": pathlib.Path("/data"), "steps": 2, "max_steps": "${model.steps}"}})
    OmegaConf.set_readonly(root, True)
    return root.model


def _file(path: Path, **extra) -> Path:
    module, optim = trained_module()
    torch.save({**LIGHTNING_STATE, "state_dict": module.state_dict(), "optimizer_states": [optim.state_dict()],
                **extra}, path)
    return path


def test_omegaconf_hyper_parameters_are_read_and_written_as_plain_containers(tmp_path, capsys):
    settings = _hydra_like()
    path = _file(tmp_path / "single.ckpt", hyper_parameters={"moe": settings.moe, "widths": settings.widths,
                                                             "all": settings}, hparams_type=DictConfig)
    checkpoint = read_lightning_checkpoint(path)
    assert checkpoint["hyper_parameters"]["moe"] == {"every": 2, "router": "softmax"}
    assert checkpoint["hyper_parameters"]["all"]["widths"] == [8, [4, 2]]
    assert checkpoint["hyper_parameters"]["all"]["max_steps"] == "${model.steps}"  # never resolved (data, not code)
    for to in ("dcp", "lightning", "pt"):
        assert main([str(path), str(tmp_path / f"out.{to}"), "--to", to]) == 0, capsys.readouterr().err
    # Lightning's own loader needs no OmegaConf class any more (the path value is a path, as it was given).
    with torch.serialization.safe_globals([pathlib.PosixPath]):
        written = torch.load(tmp_path / "out.lightning", weights_only=True)
    assert type(written["hyper_parameters"]["moe"]) is dict and written["hyper_parameters"]["widths"] == [8, [4, 2]]
    assert written["hyper_parameters"]["all"]["data"] == pathlib.Path("/data")
    assert written["hparams_type"] == "DictConfig"  # load_from_checkpoint reads a name as its AttributeDict
    assert load_plain(tmp_path / "out.dcp" / "meta.pt")["hyper_parameters"]["moe"]["router"] == "softmax"


def test_a_meta_file_holding_omegaconf_containers_loads(tmp_path):
    torch.save({"hyper_parameters": {"settings": OmegaConf.create({"a": [1, 2]})}}, tmp_path / "meta.pt")
    assert plain_containers(load_plain(tmp_path / "meta.pt")) == {"hyper_parameters": {"settings": {"a": [1, 2]}}}


@pytest.mark.parametrize("planted", ["payload_beside", "payload_in_a_node", "structured_config", "user_enum"])
def test_payloads_and_foreign_classes_are_still_refused(tmp_path, capsys, planted):
    objects = OmegaConf.create({"x": 1})
    value = {
        "payload_beside": {"cfg": objects, "evil": _Payload()},
        "payload_in_a_node": OmegaConf.create({"evil": _Payload()}, flags={"allow_objects": True}),
        "structured_config": OmegaConf.structured(Settings),
        "user_enum": OmegaConf.create({"colour": Colour.RED}),
    }[planted]
    path = _file(tmp_path / "planted.ckpt", hyper_parameters=value)
    PWNED.unlink(missing_ok=True)
    with pytest.raises(CheckpointRefused, match="tampered with.*--trust-source"):
        read_lightning_checkpoint(path)
    with pytest.raises(CheckpointRefused):
        load_plain(path)
    assert main([str(path), str(tmp_path / "out.ckpt")]) == 2
    assert "lp-convert --trust-source" in capsys.readouterr().err
    assert not PWNED.exists() and not (tmp_path / "out.ckpt").exists()


def test_trust_source_converts_a_trusted_file_with_objects_beyond_plain_values(tmp_path, capsys):
    path = _file(tmp_path / "trusted.ckpt", hyper_parameters={"ratio": fractions.Fraction(1, 3)})
    assert main([str(path), str(tmp_path / "refused.pt")]) == 2
    assert "--trust-source" in capsys.readouterr().err
    assert main([str(path), str(tmp_path / "weights.pt"), "--trust-source"]) == 0
    assert torch.load(tmp_path / "weights.pt", weights_only=True).keys() == trained_module()[0].state_dict().keys()
    assert main([str(path), str(tmp_path / "again.ckpt"), "--to", "lightning", "--trust-source"]) == 0
    rewritten = torch.load(tmp_path / "again.ckpt", weights_only=False)
    assert rewritten["hyper_parameters"]["ratio"] == fractions.Fraction(1, 3)
