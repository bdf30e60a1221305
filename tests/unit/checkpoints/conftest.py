"""Small checkpoints made on this process, with no process group: a suite DCP folder and a ZeRO-0 folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_parallel.checkpoints import optimizer_state_dict, save_on_one_process
from lightning_parallel.testing.models import ResidualMLP

WIDTH = 8
STEPS = 2
# Lightning's own entries of a checkpoint (what trainer.save_checkpoint adds beside the weights).
LIGHTNING_STATE = {"epoch": 0, "global_step": STEPS, "loops": {"fit_loop": {"epoch_progress": {}}}, "callbacks": {},
                   "lr_schedulers": [], "pytorch-lightning_version": "2.6.0"}


def trained_module(optimizer: str = "adamw", seed: int = 0) -> tuple[ResidualMLP, torch.optim.Optimizer]:
    """A tiny ResidualMLP after ``STEPS`` optimizer steps, so the optimizer holds state."""
    module = ResidualMLP(width=WIDTH, depth=2, optimizer=optimizer, seed=seed)
    optim = module.configure_optimizers()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        x, y = torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator)
        optim.zero_grad()
        F.mse_loss(module(x), y).backward()
        optim.step()
    return module, optim


@pytest.fixture
def dcp_folder(tmp_path) -> tuple[Path, ResidualMLP, torch.optim.Optimizer]:
    """A suite checkpoint folder (weights, flattened AdamW state, meta.pt), written as the strategies write it."""
    module, optim = trained_module()
    state = {"state_dict": module.state_dict(), "optimizer_0": optimizer_state_dict(module, optim)}
    path = save_on_one_process(tmp_path / "run" / "last.ckpt", state, dict(LIGHTNING_STATE))
    return path, module, optim


def write_zero0_folder(
    root: Path, module: ResidualMLP, optim: torch.optim.Optimizer, lightning: bool = True, prefix: str = ""
) -> Path:
    """A DeepSpeed ZeRO stage 0 checkpoint as Lightning's DeepSpeed strategy writes one on one process.

    The layout of DeepSpeed 0.19.8 under Lightning 2.6 (``latest`` naming the tag
    ``checkpoint``, one ``mp_rank_00_model_states.pt`` holding the engine's keys and
    Lightning's client state), checked against a real one; real folders of every stage are
    converted in ``tests/distributed/test_deepspeed_to_dcp.py``. ``prefix``: older Lightning
    versions saved the weights under ``_forward_module.``.
    """
    tag = root / "checkpoint"
    tag.mkdir(parents=True)
    (root / "latest").write_text("checkpoint")
    state = {"module": {f"{prefix}{k}": v for k, v in module.state_dict().items()},
             "optimizer": optim.state_dict(), "buffer_names": [], "lr_scheduler": None, "global_steps": STEPS,
             "skipped_steps": 0, "global_samples": 4 * STEPS, "dp_world_size": 1, "mp_world_size": 1,
             "param_shapes": None, "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
             "data_sampler": None, "random_ltd": None, "checkpoint_parallel_dimensions": None,
             "ds_config": {"zero_optimization": {"stage": 0}}, "ds_version": "0.19.8"}
    if lightning:
        state.update(LIGHTNING_STATE)
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    return root


@pytest.fixture
def zero0_folder(tmp_path) -> tuple[Path, ResidualMLP, torch.optim.Optimizer]:
    module, optim = trained_module()
    return write_zero0_folder(tmp_path / "zero0.ckpt", module, optim), module, optim
