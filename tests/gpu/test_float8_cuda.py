"""FP8 on FP8 tensor cores (``torch._scaled_mm``, not torchao's emulation): the GPT recipe trains in FP8 with losses as
close to bf16 as CPU emulation is, and the FP8 all-gather runs through FSDP2 on CUDA. Skipped without CUDA, without
FP8 tensor cores (compute capability 8.9+) or without torchao.

    pytest -q tests/gpu/test_float8_cuda.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import run_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="needs FP8 tensor cores (compute capability 8.9+)"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (pip install '.[float8]')"),
]

STEPS = 8


def _fit(rank: int, world_size: int, accelerator: str, precision: str, options: dict) -> dict:
    from lightning_parallel.testing.fit import fit_recording_losses
    from tests.distributed.parity_runs import padded_text_dataset, tiny_gpt

    model = tiny_gpt(d_model=64)
    losses = fit_recording_losses(model, HybridParallelStrategy(data_parallel_size=1, **options), 1,
                                  padded_text_dataset(256, 16), 8, STEPS, accelerator=accelerator,
                                  precision=precision, gradient_clip_val=0.5)
    layer = model.blocks["0"].attn.q
    return {"losses": losses, "kind": type(layer).__name__,
            "emulated": getattr(getattr(layer, "config", None), "emulate", None)}


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_tensor_cores_is_as_close_to_bf16_as_the_cpu_emulation(recipe):
    bf16 = run_processes(_fit, 1, "cuda", "bf16-mixed", {})[0]["losses"]
    fp8 = run_processes(_fit, 1, "cuda", "bf16-mixed", {"float8": recipe})[0]
    cpu_bf16 = run_processes(_fit, 1, "cpu", "bf16-mixed", {})[0]["losses"]
    cpu_fp8 = run_processes(_fit, 1, "cpu", "bf16-mixed", {"float8": recipe})[0]
    assert fp8["kind"] == "Float8Linear" and fp8["emulated"] is False and cpu_fp8["emulated"] is True
    gap, cpu_gap = _worst(fp8["losses"], bf16), _worst(cpu_fp8["losses"], cpu_bf16)
    print(f"{recipe}: CUDA FP8 vs bf16 {gap:.2e}; CPU emulation vs bf16 {cpu_gap:.2e}; "
          f"CUDA vs CPU FP8 {_worst(fp8['losses'], cpu_fp8['losses']):.2e}")
    assert 0 < gap < max(2 * cpu_gap, 5e-2)


def test_fp8_all_gather_under_zero3_on_cuda_gives_the_high_precision_gather():
    options = {"float8": "tensorwise", "zero_stage": 3}
    gathered_fp8 = run_processes(_fit, 1, "cuda", "32-true", {**options, "float8_all_gather": True})[0]["losses"]
    gathered_fp32 = run_processes(_fit, 1, "cuda", "32-true", {**options, "float8_all_gather": False})[0]["losses"]
    assert _worst(gathered_fp8, gathered_fp32) < 1e-4
