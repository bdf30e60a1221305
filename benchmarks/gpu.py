"""GPU mode: model FLOPs utilisation (MFU) of the GPT recipe scaled up, bf16, on one CUDA device.

    benchmarks/gpu.sh                      # = python -m benchmarks.run gpu=true sections=[]

For each strategy of ``gpu_run.strategies`` (single device, the hybrid strategy eager and with
``compile=True`` -- every block compiled with inductor --, ``deepspeed_zero2``,
``deepspeed_zero3`` through this suite, and Lightning's own ``deepspeed_stage_2`` as the
anchor that only runs on CUDA), fits the GPT recipe with ``precision="bf16-mixed"`` in a
fresh process and times the steps after warm-up. MFU = tokens/s x FLOPs/token / peak, with
FLOPs/token = 6N + 12 x layers x d_model x seq_len (N: parameters; the second term is
attention's score and value matmuls, forward and backward) and peak = 989 TFLOP/s (dense
bf16, H100/H200 SXM). Sized to finish in under 8 minutes on one H200. Without CUDA it
returns a note and runs nothing.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def flops_per_token(params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N (matmuls, forward + backward) + 12 L d T (attention)."""
    return 6 * params + 12 * n_layer * d_model * seq_len


def _strategy(name: str) -> Any:
    if name == "single":
        return "auto"
    if name.startswith("deepspeed_zero"):
        from lightning_parallel.strategies import DeepSpeedDataParallelStrategy

        return DeepSpeedDataParallelStrategy(zero_stage=int(name[-1]))
    if name in ("hybrid", "hybrid_compiled"):
        from lightning_parallel.strategies import HybridParallelStrategy

        return HybridParallelStrategy(data_parallel_size=1, compile=name == "hybrid_compiled")
    return name  # a Lightning registry name, e.g. "deepspeed_stage_2"


def _fit(rank: int, world_size: int, name: str, cfg: dict) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, Subset

    from examples.nlp.data import ByteWindows, load_corpus
    from examples.nlp.model import GPT

    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    model_kwargs = cfg["model"]
    steps = cfg["warmup"] + cfg["steps"]
    max_bytes = (steps + 2) * cfg["batch_size"] * (model_kwargs["seq_len"] + 1) + 10**6
    train, _ = load_corpus(None, max_bytes=max_bytes, val_every=10)
    data = Subset(ByteWindows(train, model_kwargs["seq_len"]), range((steps + 2) * cfg["batch_size"]))
    torch.manual_seed(0)
    model = GPT(**model_kwargs).build()
    params = sum(p.numel() for p in model.parameters())
    trainer = pl.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", strategy=_strategy(name),
                         max_steps=steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[Clock()])
    trainer.fit(model, DataLoader(data, batch_size=cfg["batch_size"], drop_last=True))
    step_s = statistics.median(b - a for a, b in zip(times[cfg["warmup"]:], times[cfg["warmup"] + 1:]))
    tokens = cfg["batch_size"] * model_kwargs["seq_len"] / step_s
    flops = flops_per_token(params, model_kwargs["n_layer"], model_kwargs["d_model"], model_kwargs["seq_len"])
    return {"strategy": name, "params": params, "step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(tokens),
            "tflops": round(tokens * flops / 1e12, 1), "mfu": round(tokens * flops / (cfg["peak_tflops"] * 1e12), 4),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "device": torch.cuda.get_device_name()}


def run_gpu(cfg: dict) -> dict:
    """MFU rows for every strategy of ``cfg["strategies"]``, or a note when there is no CUDA device.

    Args:
        cfg: ``model`` (GPT kwargs), ``batch_size``, ``steps``, ``warmup``, ``strategies``, ``peak_tflops``.
    """
    import torch

    if not torch.cuda.is_available():
        return {"note": "Skipped: no CUDA device on this machine (run benchmarks/gpu.sh on a GPU)."}
    from lightning_parallel.testing import run_processes

    rows = []
    for name in cfg["strategies"]:
        try:
            rows.append(run_processes(_fit, 1, name, cfg, timeout=420, env={"OMP_NUM_THREADS": "8"})[0])
        except Exception as err:  # noqa: BLE001 - one strategy failing must not lose the others' rows
            rows.append({"strategy": name, "error": str(err)[-400:]})
    return {
        "note": f"{cfg['model']}, batch {cfg['batch_size']}, bf16-mixed, peak {cfg['peak_tflops']} TFLOP/s",
        "rows": rows,
    }
