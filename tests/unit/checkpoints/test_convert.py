"""``lp-convert``: DCP -> pt and dcp exactly, DeepSpeed -> dcp/pt, and one-line refusals (exit 2, nothing written)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoints import is_sharded_checkpoint, load_sharded_checkpoint
from lightning_parallel.checkpoints.safe_loading import SafeFileSystemReader
from lightning_parallel.cli.convert import AVAILABLE, main
from lightning_parallel.testing.models import ResidualMLP

from .conftest import WIDTH

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _refused(capsys, argv: list[str], *fragments: str) -> str:
    """Run the command, expect exit 2 and one stderr line ``lp-convert: error: ...`` holding ``fragments``."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lp-convert: error: "), captured.err
    assert "Traceback" not in captured.err and not captured.out
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_dcp_to_pt_equals_the_source_tensors_exactly(dcp_folder, tmp_path, capsys):
    path, module, _ = dcp_folder
    assert main([str(path), str(tmp_path / "model.pt")]) == 0  # --to pt from the suffix
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert plain.keys() == module.state_dict().keys()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain[name], value, rtol=0, atol=0)
    out = capsys.readouterr().out
    assert f"{len(plain)} tensors" in out and "values" in out and "bytes" in out
    assert not list(tmp_path.glob(".*"))  # written under a hidden name, then renamed


def test_a_tampered_folder_is_refused_in_one_line(dcp_folder, tmp_path, capsys):
    path, _, _ = dcp_folder
    with open(path / ".metadata", "wb") as f:
        pickle.dump(_Payload(), f)
    _refused(capsys, [str(path), str(tmp_path / "model.pt")], "Refusing to load a checkpoint", "posix.system")
    assert not (tmp_path / "model.pt").exists()


def test_a_truncated_shard_is_refused_in_one_line(dcp_folder, tmp_path, capsys):
    path, _, _ = dcp_folder
    for shard in path.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _refused(capsys, [str(path), str(tmp_path / "model.pt")], "damaged or incomplete checkpoint")
    assert not (tmp_path / "model.pt").exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lightning_parallel_pwned_cli",))


def test_a_missing_or_foreign_source_is_one_line(tmp_path, capsys):
    _refused(capsys, [str(tmp_path / "missing"), str(tmp_path / "x.ckpt")], "does not exist",
             "not a DeepSpeed checkpoint folder", AVAILABLE)
    (tmp_path / "model.ckpt").write_bytes(b"not a checkpoint")
    _refused(capsys, [str(tmp_path / "model.ckpt"), str(tmp_path / "x.pt")], "a file")
    assert not (tmp_path / "x.ckpt").exists() and not (tmp_path / "x.pt").exists()


def test_requests_the_source_cannot_serve_are_refused(dcp_folder, zero0_folder, tmp_path, capsys):
    path, _, _ = dcp_folder
    deepspeed, _, _ = zero0_folder
    _refused(capsys, [str(path), str(tmp_path / "m.pt"), "--tag", "checkpoint"], "--tag applies to a DeepSpeed")
    _refused(capsys, [str(path), str(tmp_path / "m.ckpt"), "--module", "x.Y"], "--module applies where")
    _refused(capsys, [str(deepspeed), str(tmp_path / "m.pt"), "--module", "x.Y"], "--module applies where")
    _refused(capsys, [str(deepspeed), str(tmp_path / "m.pt"), "--no-optimizer"], "--no-optimizer applies")
    _refused(capsys, [str(deepspeed), str(tmp_path / "m.ckpt"), "--tag", "nope"], "does not exist: check tag=")
    assert not [p for p in tmp_path.iterdir() if p.name not in {"run", "zero0.ckpt"}]


def test_a_suite_folder_converted_to_its_own_format_is_the_same_checkpoint(dcp_folder, tmp_path, capsys):
    """dcp -> dcp rewrites the folder (--no-optimizer strips the optimizer); the state is unchanged."""
    path, module, optim = dcp_folder
    assert main([str(path), str(tmp_path / "again.ckpt")]) == 0
    assert main([str(path), str(tmp_path / "weights.ckpt"), "--no-optimizer"]) == 0
    assert "left out" in capsys.readouterr().out
    fresh = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=1)
    fresh_optim = fresh.configure_optimizers()
    load_sharded_checkpoint(tmp_path / "again.ckpt", fresh, [fresh_optim])
    for name, value in module.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)
    for a, b in zip(optim.state_dict()["state"].values(), fresh_optim.state_dict()["state"].values()):
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    assert not [k for k in SafeFileSystemReader(tmp_path / "weights.ckpt").read_metadata().state_dict_metadata
                if k.startswith("optimizer_")]


def test_deepspeed_to_dcp_and_to_pt(zero0_folder, tmp_path, capsys):
    source, module, _ = zero0_folder
    assert main([str(source), str(tmp_path / "converted.ckpt"), "--no-optimizer"]) == 0
    assert "wrote DCP checkpoint" in capsys.readouterr().out and is_sharded_checkpoint(tmp_path / "converted.ckpt")
    fresh = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=1)
    optim = fresh.configure_optimizers()
    meta = load_sharded_checkpoint(tmp_path / "converted.ckpt", fresh, [optim])
    assert meta["lightning_parallel"]["source"].endswith("optimizer reset")
    assert main([str(source), str(tmp_path / "forced"), "--to", "pt", "--tag", "checkpoint"]) == 0
    plain = torch.load(tmp_path / "forced", weights_only=True)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain[name], value, rtol=0, atol=0)
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)


def test_the_console_script_is_installed_and_refuses_without_a_traceback(tmp_path):
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "lp-convert"]
    assert script.value == "lightning_parallel.cli.convert:main"
    executable = Path(sys.executable).with_name("lp-convert")
    if not executable.is_file():
        pytest.skip("the package is not installed with its scripts (pip install -e .)")
    run = subprocess.run([str(executable), str(tmp_path), str(tmp_path / "out"), "--to", "hf"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert run.stderr.startswith("lp-convert: error: ") and "is not a DeepSpeed checkpoint folder" in run.stderr
    assert not (tmp_path / "out").exists()
