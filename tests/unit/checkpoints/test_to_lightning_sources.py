"""Lightning's own checkpoints turned into the suite's folder (``--to dcp``) or weights (``--to pt``) ahead of time."""

from __future__ import annotations

import torch

from lightning_parallel.checkpoints import load_sharded_checkpoint
from lightning_parallel.cli.convert import main
from lightning_parallel.testing.models import ResidualMLP

from .conftest import LIGHTNING_STATE, WIDTH, trained_module


def test_a_lightning_file_becomes_a_suite_folder_and_a_state_dict(tmp_path, capsys):
    module, optim = trained_module()
    file = tmp_path / "single.ckpt"
    torch.save({**LIGHTNING_STATE, "state_dict": module.state_dict(), "optimizer_states": [optim.state_dict()]}, file)
    assert main([str(file), str(tmp_path / "suite.ckpt")]) == 0
    assert "optimizer state carried over" in capsys.readouterr().out
    fresh = ResidualMLP(width=WIDTH, depth=2, optimizer="adamw", seed=1)
    fresh_optim = fresh.configure_optimizers()
    meta = load_sharded_checkpoint(tmp_path / "suite.ckpt", fresh, [fresh_optim])
    assert meta["global_step"] == LIGHTNING_STATE["global_step"]
    assert "single-file Lightning" in meta["lightning_parallel"]["source"]
    for name, value in module.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)
    for (a, b) in zip(optim.state_dict()["state"].values(), fresh_optim.state_dict()["state"].values()):
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    assert main([str(file), str(tmp_path / "weights.pt")]) == 0
    plain = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert plain.keys() == module.state_dict().keys()
    assert main([str(file), str(tmp_path / "again.ckpt"), "--to", "lightning"]) == 0  # written again, as it was
    again = torch.load(tmp_path / "again.ckpt", weights_only=True)
    assert again["optimizer_states"][0]["param_groups"] == optim.state_dict()["param_groups"]
    for name, value in module.state_dict().items():
        torch.testing.assert_close(again["state_dict"][name], value, rtol=0, atol=0)


def test_outputs_a_suite_folder_cannot_serve_are_refused_in_one_line_writing_nothing(dcp_folder, tmp_path, capsys):
    """The conftest folder records neither the param-group order nor the Hugging Face model."""
    path, _, _ = dcp_folder
    for argv, fragments in (
        (["--to", "lightning"], ("lp-convert: error: ", "by index in configure_optimizers order", "--no-optimizer")),
        (["--to", "hf"], ("lp-convert: error: ", "pass --hf-config")),
        (["--to", "pt", "--hf-config", str(tmp_path)], ("--hf-config applies to --to hf only",)),
    ):
        assert main([str(path), str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(f in err for f in fragments), err
    assert list(tmp_path.iterdir()) == [path.parent]

