"""``offload="params"`` on CUDA: FSDP2's CPUOffloadPolicy takes the parameters, gradients and optimizer state off
the device, and the fit matches the one without it. Skipped without CUDA.

Run on a GPU machine with ``pytest -q tests/gpu/test_offload_cuda.py`` (one device: ZeRO-3 on a data axis of one
rank still runs FSDP2 and its offload policy; the multi-rank numbers are checked on CPU in
``tests/distributed/strategies/test_offload_parity.py``, where the policy moves nothing).

What is measured, after each optimizer step (``on_train_batch_end``): ``torch.cuda.memory_allocated()``,
i.e. the tensors that stay on the device between steps (parameters, gradients, AdamW's two moments:
4 x the parameter bytes without offload, ~0 with it), and ``torch.cuda.max_memory_allocated()`` over the fit.
"""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes
from lightning_parallel.testing.fit import quiet_trainer
from lightning_parallel.testing.models import DeferredResidualMLP, FixedOrderData, ResidualMLP, regression_dataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS = 8
BATCH = 16
WIDTH = 512  # ~4.7M parameters (19 MB fp32): states of 75 MB, far above the allocator's noise
# The optimizer steps on the CPU with offload (another AdamW kernel than CUDA's): losses agree closely, not bitwise.
TOL = 1e-4
ADAMW = partial(torch.optim.AdamW, lr=1e-4, weight_decay=0.01)


class DeviceMemory(pl.Callback):
    """Bytes allocated on the device after each optimizer step, and the peak over the fit."""

    def __init__(self) -> None:
        self.resident: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.resident.append(torch.cuda.memory_allocated())


def _fit(rank: int, world_size: int, offload: str, deferred: bool, clip: float | None) -> dict[str, object]:
    pl.seed_everything(0)
    strategy = HybridParallelStrategy(data_parallel_size=1, zero_stage=3, offload=offload)
    history, memory = LossHistory(), DeviceMemory()
    trainer = quiet_trainer(1, strategy, STEPS, [history, memory], accelerator="cuda", gradient_clip_val=clip)
    # lr 1e-4: AdamW at the models' default 1e-2 diverges at this width (losses 0.6 -> 2076 in 5 steps), and a
    # diverging run turns the host's and the device's rounding into differences of 1e-3.
    model = (DeferredResidualMLP if deferred else ResidualMLP)(width=WIDTH, depth=4, optimizer=ADAMW)
    trainer.fit(model, datamodule=FixedOrderData(regression_dataset(256, WIDTH), BATCH))
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    states = [t for s in trainer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t) and t.ndim]
    return {"losses": history.losses, "resident": min(memory.resident), "peak": torch.cuda.max_memory_allocated(),
            "param_bytes": sum(p.numel() * p.element_size() for p in local),
            "param_devices": sorted({p.device.type for p in local}),
            "state_devices": sorted({t.device.type for t in states})}


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "configure_model"])
def test_offload_takes_states_off_the_device_and_trains_the_same(deferred):
    off = run_processes(_fit, 1, "none", deferred, None)[0]
    on = run_processes(_fit, 1, "params", deferred, None)[0]
    print(f"device bytes after a step: {off['resident']} -> {on['resident']}; peak {off['peak']} -> {on['peak']}; "
          f"parameters {off['param_bytes']} bytes; max |loss diff| {max_abs_difference(on['losses'], off['losses'])}")
    assert off["param_devices"] == off["state_devices"] == ["cuda"]
    assert on["param_devices"] == on["state_devices"] == ["cpu"]  # sharded parameters and AdamW state on the host
    # Parameters, gradients and AdamW's two moments leave the device: at least 3 of their 4 copies' worth.
    assert off["resident"] - on["resident"] >= 3 * off["param_bytes"]
    assert on["peak"] < off["peak"]
    assert max_abs_difference(on["losses"], off["losses"]) < TOL


def test_offload_with_gradient_clipping():
    """The global norm is computed over gradients that live on the CPU (a collective over host tensors)."""
    off = run_processes(_fit, 1, "none", False, 0.5)[0]
    on = run_processes(_fit, 1, "params", False, 0.5)[0]
    assert on["state_devices"] == ["cpu"]
    assert max_abs_difference(on["losses"], off["losses"]) < TOL
