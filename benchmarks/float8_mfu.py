"""Tokens/s and MFU of a 1.5B decoder on one GPU: bf16 eager, bf16 compiled, FP8 tensorwise and FP8 rowwise.

    benchmarks/gpu.sh float8                            # one CUDA device (FP8: compute capability 8.9+, torchao)
    python -m benchmarks.float8_mfu --variants bf16_compiled fp8_tensorwise --steps 10
    python -m benchmarks.float8_mfu --dry-run           # CPU, a tiny model, 3 steps: checks the path, times nothing

The decoder is a Llama-3-shaped ``transformers.LlamaForCausalLM`` built from a config with random weights (hidden
2048, 16 layers, 32 heads over 8 key/value heads, SwiGLU 8192, vocabulary 128,256, untied head: 1.50B parameters;
nothing downloads); without transformers, the GPT recipe at 1.21B (d 2048, 24 blocks, vocabulary 256), named in the
results. Each variant trains in a fresh process through the hybrid strategy (``data_parallel_size=1``,
``precision="bf16-mixed"``: fp32 masters, bf16 autocast; the model built on meta and materialised on the device);
``compile=True`` compiles every block with inductor, and the FP8 variants are compiled too (torchao's casts are fused
there; eager FP8 is slower than bf16). Random token batches, AdamW (fused on CUDA). The step time is the median after
the warm-up steps (where compilation happens).

MFU = tokens/s x FLOPs/token / peak. FLOPs/token = 6 x (parameters - input embedding) + 12 x layers x attention width
x sequence (torchtitan's count; the input embedding is a lookup). The peaks are the device's dense bf16 and FP8 tensor
throughput (:data:`PEAKS`, by device name): every row is given against both, since an FP8 run still computes
attention, the head and the norms in bf16. The first and last losses of each variant are kept: the variants start
from the same weights and batches, so their first losses differ only by FP8 rounding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any, Optional

VARIANTS: dict[str, dict[str, Any]] = {
    "bf16_eager": {"float8": None, "compile": False},
    "bf16_compiled": {"float8": None, "compile": True},
    "fp8_tensorwise": {"float8": "tensorwise", "compile": True},
    "fp8_rowwise": {"float8": "rowwise", "compile": True},
}
LLAMA_1B5 = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 2048,
             "tie_word_embeddings": False, "rope_theta": 500000.0}
GPT_1B2 = {"vocab_size": 256, "d_model": 2048, "n_layer": 24, "n_head": 16}
FULL = {"seq_len": 2048, "batch_size": 4, "warmup": 4, "steps": 12, "lr": 1e-4}
# The dry run: the same path at a size two CPU cores take in seconds; compile through dynamo only (no codegen).
DRY = {"seq_len": 32, "batch_size": 2, "warmup": 1, "steps": 2, "lr": 1e-3, "compile_backend": "eager",
       "llama": {**LLAMA_1B5, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64},
       "gpt": {"vocab_size": 256, "d_model": 64, "n_layer": 2, "n_head": 4}}

#: Dense tensor-core peaks (FLOP/s) by a substring of ``torch.cuda.get_device_name()``: (bf16, FP8). Vendor data
#: sheets, without sparsity; the first match wins (the specific names first).
PEAKS: tuple[tuple[str, float, Optional[float]], ...] = (
    ("H100 PCIe", 756e12, 1513e12), ("H100 NVL", 835e12, 1671e12), ("H100", 989e12, 1979e12),
    ("H200", 989e12, 1979e12), ("GB200", 2500e12, 5000e12), ("B200", 2250e12, 4500e12),
    ("L40S", 362e12, 733e12), ("L4", 121e12, 242.5e12), ("A100", 312e12, None),
)


def peaks_of(device_name: str) -> tuple[Optional[float], Optional[float]]:
    """``(bf16, FP8)`` dense peak FLOP/s of a device by its name; None where unknown or without FP8."""
    for key, bf16, fp8 in PEAKS:
        if key in device_name:
            return bf16, fp8
    return None, None


def flops_per_token(params: int, embedding: int, layers: int, attention_width: int, seq_len: int) -> float:
    """6 x (parameters - input embedding) + 12 x layers x attention width x sequence length."""
    return 6 * (params - embedding) + 12 * layers * attention_width * seq_len


def _decoder(kind: str, shape: dict, lr: float) -> Any:
    """The LightningModule: a Llama from a config (built in ``configure_model``, on meta under the strategy), or the
    GPT recipe."""
    import lightning.pytorch as pl
    import torch

    if kind == "gpt":
        from functools import partial

        from examples.nlp.model import GPT

        return GPT(**shape, optimizer=partial(torch.optim.AdamW, lr=lr, fused=torch.cuda.is_available()))

    class Decoder(pl.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                import transformers

                self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=lr, fused=torch.cuda.is_available())

    return Decoder()


def _batches(kind: str, vocab: int, count: int, batch: int, seq_len: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    tokens = torch.randint(0, vocab, (count * batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    if kind == "gpt":  # (inputs, next tokens)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    return DataLoader(tokens[:, :-1], batch_size=batch)  # transformers shifts the labels itself


def _fit(rank: int, world_size: int, variant: str, kind: str, shape: dict, run: dict) -> dict:
    import lightning.pytorch as pl
    import torch

    from lightning_parallel.strategies import HybridParallelStrategy

    cuda = torch.cuda.is_available() and not run.get("dry_run")
    times, losses = [], []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize() if cuda else None
            times.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    options = dict(VARIANTS[variant])
    if options["compile"] and run.get("compile_backend"):
        options["compile"] = run["compile_backend"]
    steps = run["warmup"] + run["steps"]
    torch.manual_seed(0)
    model = _decoder(kind, shape, run["lr"])
    trainer = pl.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, precision="bf16-mixed",
                         strategy=HybridParallelStrategy(data_parallel_size=1, **options), max_steps=steps + 1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[Clock()])
    trainer.fit(model, _batches(kind, shape["vocab_size"], steps + 2, run["batch_size"], run["seq_len"]))
    step_s = statistics.median(b - a for a, b in zip(times[run["warmup"]:], times[run["warmup"] + 1:]))
    params = sum(p.numel() for p in model.parameters())
    embedding = shape["vocab_size"] * (shape.get("hidden_size") or shape["d_model"])
    layers = shape.get("num_hidden_layers") or shape["n_layer"]
    width = shape["num_attention_heads"] * shape["head_dim"] if kind == "llama" else shape["d_model"]
    tokens = run["batch_size"] * run["seq_len"] / step_s
    flops = tokens * flops_per_token(params, embedding, layers, width, run["seq_len"])
    name = torch.cuda.get_device_name() if cuda else "cpu"
    bf16_peak, fp8_peak = peaks_of(name) if cuda else (None, None)
    fp8 = trainer.strategy.parallelized.float8
    return {"variant": variant, "model": kind, "params": params, "device": name, "step_ms": round(1e3 * step_s, 2),
            "tokens_per_s": round(tokens), "tflops": round(flops / 1e12, 2),
            "mfu_bf16_peak": round(flops / bf16_peak, 4) if bf16_peak else None,
            "mfu_fp8_peak": round(flops / fp8_peak, 4) if fp8_peak else None,
            "first_loss": losses[0], "last_loss": losses[-1],
            "fp8_layers": len(fp8.converted) if fp8 is not None else 0,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


def _fit_each(rank: int, world_size: int, variants: list[str], kind: str, shape: dict, run: dict) -> list[dict]:
    return [_fit(rank, world_size, variant, kind, shape, run) for variant in variants]


def measure(variants: list[str], run: dict, model: Optional[str] = None) -> dict:
    """One row per variant (a failing variant gets a row with its error), and what was measured.

    Args:
        variants: keys of :data:`VARIANTS`.
        run: ``seq_len``, ``batch_size``, ``warmup``, ``steps``, ``lr`` (and ``dry_run``, ``compile_backend``).
        model: ``"llama"`` or ``"gpt"``; None: llama where transformers imports, else gpt (said in the note).
    """
    import importlib.util

    import torch

    from lightning_parallel.testing import run_processes

    if not run.get("dry_run") and not torch.cuda.is_available():
        return {"note": "Skipped: no CUDA device on this machine (run benchmarks/gpu.sh float8 on a GPU).", "rows": []}
    have_hf = importlib.util.find_spec("transformers") is not None
    kind = model or ("llama" if have_hf else "gpt")
    shape = (DRY[kind] if run.get("dry_run") else (LLAMA_1B5 if kind == "llama" else GPT_1B2))
    shape = shape if kind == "llama" else {**shape, "seq_len": run["seq_len"]}
    rows = []
    if run.get("dry_run"):  # one process for every variant: it checks the path, a fresh process per variant is slow
        rows = run_processes(_fit_each, 1, variants, kind, shape, run, timeout=600, env={"OMP_NUM_THREADS": "1"})[0]
    for variant in [] if run.get("dry_run") else variants:
        try:  # a fresh process per variant: its own compile caches and memory peak
            rows.append(run_processes(_fit, 1, variant, kind, shape, run, timeout=run.get("timeout", 300),
                                      env={"OMP_NUM_THREADS": "8"})[0])
        except Exception as err:  # noqa: BLE001 - one variant failing must not lose the others' rows
            rows.append({"variant": variant, "error": str(err)[-600:]})
        print(f"[float8_mfu] {render_rows(rows[-1:]).splitlines()[-1]}", flush=True)
    why = "" if model or have_hf else " (transformers is not installed: the GPT recipe instead of the Llama)"
    return {"note": f"{kind}{why}, batch {run['batch_size']} x {run['seq_len']} tokens, bf16-mixed, "
                    f"{run['warmup']} warm-up + {run['steps']} timed steps", "shape": shape, "rows": rows}


def render_rows(rows: list[dict]) -> str:
    """A markdown table of :func:`measure`'s rows."""
    lines = ["| variant | step ms | tokens/s | TFLOP/s | MFU (bf16 peak) | MFU (FP8 peak) | FP8 layers | first / last "
             "loss | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'].splitlines()[-1][:160]} |||||||| ")
            continue
        mfu = [f"{r[k]:.1%}" if r[k] is not None else "-" for k in ("mfu_bf16_peak", "mfu_fp8_peak")]
        lines.append(f"| {r['variant']} | {r['step_ms']} | {r['tokens_per_s']:,} | {r['tflops']} | {mfu[0]} | "
                     f"{mfu[1]} | {r['fp8_layers']} | {r['first_loss']:.4f} / {r['last_loss']:.4f} | "
                     f"{r['peak_memory_gib'] if r['peak_memory_gib'] is not None else '-'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--model", choices=["llama", "gpt"], default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant (after the warm-up)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, 3 steps: checks the path only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args(argv)
    run = {**({k: v for k, v in DRY.items() if k not in ("llama", "gpt")} if args.dry_run else FULL),
           "dry_run": args.dry_run}
    run["steps"] = args.steps or run["steps"]
    start = time.perf_counter()
    result = measure(args.variants, run, args.model)
    import torch

    result["meta"] = {"date": str(date.today()), "runtime_s": round(time.perf_counter() - start, 1),
                      "torch": torch.__version__, "torchao": _version("torchao"), "dry_run": args.dry_run}
    name = "float8_mfu_dry_run" if args.dry_run else "float8_mfu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    table = render_rows(result["rows"]) if result["rows"] else ""
    (args.out / f"{name}.md").write_text(f"# FP8 against bf16 on one device\n\n{result['note']}\n\n{table}\n")
    print(f"[float8_mfu] wrote {args.out}/{name}.json and .md in {result['meta']['runtime_s']:.0f} s", flush=True)
    return result


def _version(package: str) -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
