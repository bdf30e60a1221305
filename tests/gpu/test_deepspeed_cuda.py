"""DeepSpeed ZeRO 2 and 3 on one CUDA device with bf16 mixed precision; skipped without CUDA.

Run on a GPU machine with ``pytest -q tests/gpu/test_deepspeed_cuda.py``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import LossHistory, run_processes
from lightning_parallel.testing.fit import quiet_trainer
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 10
BATCH = 16


def _fit(rank: int, world_size: int, stage, precision: str, root: str) -> dict[str, object]:
    """Fit the test model on cuda:0; for DeepSpeed also save, reload and consolidate the checkpoint."""
    pl.seed_everything(0)
    strategy = "auto" if stage is None else DeepSpeedDataParallelStrategy(zero_stage=stage)
    history = LossHistory()
    trainer = quiet_trainer(1, strategy, STEPS, [history], accelerator="cuda", precision=precision)
    trainer.fit(ResidualMLP(optimizer="adamw"), datamodule=FixedOrderData(regression_dataset(256, 32), BATCH))
    result: dict[str, object] = {"losses": history.losses}
    if stage is not None:
        engine = trainer.strategy.deepspeed_engine
        # bf16-mixed is DeepSpeed's torch_autocast (fp32 weights, bf16 matmuls), not its bf16 block.
        result["bf16"] = bool(engine.torch_autocast_enabled()) and not engine.bfloat16_enabled()
        result["device"] = str(next(engine.module.parameters()).device)
        path = Path(root) / f"zero{stage}.ckpt"
        trainer.save_checkpoint(path)
        from lightning_parallel.checkpoints import consolidate_state_dict

        state = consolidate_state_dict(path)
        fresh = ResidualMLP()
        fresh.load_state_dict(state)
        result["dtypes"] = sorted({str(t.dtype) for t in state.values()})
    return result


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory) -> list[float]:
    return run_processes(_fit, 1, None, "32-true", str(tmp_path_factory.mktemp("ref")))[0]["losses"]


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_on_one_cuda_device(fp32_reference, tmp_path, stage):
    result = run_processes(_fit, 1, stage, "bf16-mixed", str(tmp_path))[0]
    losses = result["losses"]
    assert result["bf16"] and result["device"].startswith("cuda")
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    # bf16 keeps ~3 significant digits: close to the fp32 curve, not equal to it.
    assert max(abs(a - b) for a, b in zip(losses, fp32_reference)) < 5e-2
    assert result["dtypes"] == ["torch.float32"]  # consolidated master weights are fp32
