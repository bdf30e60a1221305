"""FSDP2 mixed precision on CUDA under ``bf16-mixed``: bf16 parameters in compute, fp32 masters and optimizer
state, and losses as close to one device in bf16 as that device is to fp32. Skipped without CUDA.

Run on a GPU machine with ``pytest -q tests/gpu/test_bf16_fsdp2.py`` (one device: FSDP2 on a
data axis of one rank still casts through its policy; the multi-rank reductions are checked on
CPU in ``tests/distributed/strategies/test_precision_parity.py``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.fit import quiet_trainer
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 16
BATCH = 16


class ComputeDtypes(pl.Callback):
    """The dtype the first block's ``up`` weight has while it computes (FSDP2's unsharded parameter)."""

    def __init__(self) -> None:
        self.dtypes: set[str] = set()

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.blocks["0"].up.register_forward_hook(lambda m, args, out: self.dtypes.add(str(m.weight.dtype)))


def _fit(rank: int, world_size: int, zero_stage, precision: str) -> dict[str, object]:
    pl.seed_everything(0)
    strategy = "auto" if zero_stage is None else HybridParallelStrategy(data_parallel_size=1, zero_stage=zero_stage)
    history, compute = LossHistory(), ComputeDtypes()
    trainer = quiet_trainer(1, strategy, STEPS, [history, compute], accelerator="cuda", precision=precision,
                            gradient_clip_val=0.5)
    model = ResidualMLP(optimizer="adamw")
    trainer.fit(model, datamodule=FixedOrderData(regression_dataset(256, 32), BATCH))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    states = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t) and t.ndim]
    return {"losses": history.losses, "compute": sorted(compute.dtypes),
            "masters": sorted({str(p.dtype) for p in local}), "device": str(local[0].device),
            "optimizer_state": sorted({str(t.dtype) for t in states})}


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return {p: run_processes(_fit, 1, None, p)[0]["losses"] for p in ("bf16-mixed", "32-true")}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_fsdp2_bf16_mixed_computes_in_bf16_keeps_fp32_masters_and_matches_one_device(references, zero_stage):
    result = run_processes(_fit, 1, zero_stage, "bf16-mixed")[0]
    assert result["device"].startswith("cuda")
    assert result["compute"] == ["torch.bfloat16"]  # FSDP2's param_dtype
    assert result["masters"] == ["torch.float32"] and result["optimizer_state"] == ["torch.float32"]
    own_error = max_abs_difference(references["bf16-mixed"], references["32-true"])
    assert own_error > 0  # bf16 really ran
    assert max_abs_difference(result["losses"], references["bf16-mixed"]) <= own_error
