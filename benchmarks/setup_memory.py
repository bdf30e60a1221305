"""Per-rank memory added from process start to the first optimizer step, beside each rank's ideal share.

    python -m benchmarks.setup_memory                       # the ~1 GB Llama decoder, every layout, both builds
    python -m benchmarks.setup_memory --layouts pp2xtp2 --inits random --small

A Hugging Face Llama decoder (hidden 1024, 16 layers, vocab 32000, fp32: about 1 GiB) is trained for one
step (AdamW, batch 2 x 16 tokens per data rank) on 4 CPU processes under each layout, twice: built in the module's
``__init__`` (every rank builds the whole model, then the strategy splits it: the old behaviour) and built
in ``configure_model`` (on ``meta`` under the suite's strategies: each rank allocates only its share). Each
run starts fresh processes, because peak resident memory only grows.

Memory: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (peak resident set) on every rank, read once after
the imports (the baseline), at the start of batch 0 (the *setup peak*: everything built, loaded and
materialised, nothing computed) and at the end of batch 0 (after the first optimizer step: gradients and
AdamW's two moments exist). "Added" is the peak minus the baseline; the table shows the largest over ranks.

Ideal share: the model's full bytes (parameters and buffers) divided by the ranks that split it -- the
model-parallel ranks (pipeline x tensor), times the data ranks that shard parameters under ZeRO-3. All four
layouts here divide by 4. Pretrained: the same model saved once with ``save_pretrained`` into a temporary
folder and loaded by :class:`~lightning_parallel.callbacks.hf_weights.HuggingFaceWeights` (each rank reads
its slices) for the suite's layouts; DeepSpeed ZeRO-3 parameters are refused there, so under DeepSpeed the
module calls ``from_pretrained(folder)`` in the place it builds the model (``__init__`` or ``configure_model``).
The calibration rows (``--calibrate``) run a ~0.5 MiB decoder: what a rank adds whatever the model size.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path
from typing import Any

LAYOUTS: dict[str, tuple[str, dict]] = {
    "pp2xtp2": ("hybrid", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "microbatches": 2}),
    "dp4_zero3": ("hybrid", {"data_parallel_size": 4, "zero_stage": 3}),
    "dp2xpp2_zero3": ("hybrid", {"data_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 3,
                                 "microbatches": 2}),
    "deepspeed_zero3": ("deepspeed", {"zero_stage": 3}),
}
WORLD = 4
# The decoder: LlamaConfig hidden 1024, 16 layers, vocab 32000 (MLP 2816 = Llama's 8/3 ratio, rounded).
MODEL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
         "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 256, "tie_word_embeddings": False}
SMALL = {**MODEL, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "vocab_size": 16000}
TINY = {**MODEL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 512}
SEQ, BATCH = 16, 2  # per data rank: two micro-batches of 1 x 16 tokens under pipelining
BUILDS = ("init", "configure_model")
HOW = ("How: a Hugging Face Llama decoder trained for one AdamW step (batch 2 x 16 tokens per data rank, two "
       "micro-batches under pipelining) on 4 CPU processes per layout and build, each run in fresh processes. "
       "Memory: `ru_maxrss` (peak resident set) per rank after the imports (baseline), at the start of batch 0 "
       "(setup peak) and at its end (after the first optimizer step); added = peak - baseline, max over ranks. "
       "Share = full model bytes / ranks that split it (pipeline x tensor x ZeRO-3 data ranks; 4 for every layout "
       "here). `init`: the model built in the module's `__init__` (every rank holds all of it before the split); "
       "`configure_model`: built there (on meta under the suite's strategies). Resident memory includes the "
       "memory-mapped safetensors pages a rank reads while loading.")


def _rss_mib() -> tuple[float, float]:
    """(peak resident MiB since the process started, resident MiB now)."""
    import os
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    now = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return peak, now


def decoder_class() -> type:
    """The LightningModule: a Llama decoder built in ``__init__`` or in ``configure_model``, random or pretrained."""
    import lightning.pytorch as pl
    import torch
    import transformers

    class Decoder(pl.LightningModule):
        def __init__(self, config: dict, build: str, pretrained: str | None = None) -> None:
            super().__init__()
            self.config_kwargs, self.build, self.pretrained = config, build, pretrained
            if build == "init":
                self.model = self._make()

        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = self._make()

        def _make(self) -> Any:
            if self.pretrained:  # only where HuggingFaceWeights cannot load (DeepSpeed ZeRO-3)
                if self.build == "configure_model":  # inside zero.Init: transformers must know (its ZeRO-3 loader)
                    from transformers.integrations import HfDeepSpeedConfig

                    self._zero3 = HfDeepSpeedConfig(self.trainer.strategy.config)  # transformers keeps a weak ref
                return transformers.LlamaForCausalLM.from_pretrained(self.pretrained, attn_implementation="sdpa")
            cfg = transformers.LlamaConfig(**self.config_kwargs)
            return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")

        def training_step(self, batch: dict, batch_idx: int) -> Any:
            loss = self.model(**batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Decoder


def probe_callback() -> Any:
    """Reads the peak resident memory at the start and the end of batch 0, and the parameter bytes this rank holds."""
    import lightning.pytorch as pl

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.values: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.values["setup_peak"], self.values["setup_now"] = _rss_mib()
                self.values["held_mib"] = held_bytes(module) / 2**20

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.values["step_peak"], self.values["step_now"] = _rss_mib()
                loss = outputs["loss"] if isinstance(outputs, dict) else outputs
                self.values["loss"] = float(loss) if loss is not None else None

    return Probe()


def held_bytes(module: Any) -> int:
    """Bytes of the parameters and buffers this rank stores (a DTensor's local shard, a ZeRO-3 partition)."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if hasattr(tensor, "ds_tensor"):
            tensor = tensor.ds_tensor
        elif hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        total += tensor.numel() * tensor.element_size()
    return total


def _strategy(layout: str) -> Any:
    from lightning_parallel.strategies import DeepSpeedDataParallelStrategy, HybridParallelStrategy

    kind, kwargs = LAYOUTS[layout]
    return DeepSpeedDataParallelStrategy(**kwargs) if kind == "deepspeed" else HybridParallelStrategy(**kwargs)


def _batches(vocab: int, steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader

    tokens = torch.randint(0, vocab, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": t, "labels": t} for t in tokens]  # the same batches on every rank
    return DataLoader(samples, batch_size=BATCH)


def rank_run(rank: int, world: int, layout: str, config: dict, build: str, folder: str | None) -> dict:
    """One rank: baseline after the imports, one training step, the peaks (MiB). ``folder``: pretrained weights."""
    import gc
    import warnings

    import deepspeed  # noqa: F401 - imported before the baseline on every layout alike
    import lightning.pytorch as pl
    import transformers  # noqa: F401

    from lightning_parallel.callbacks.hf_weights import HuggingFaceWeights

    warnings.filterwarnings("ignore")
    gc.collect()
    baseline, baseline_now = _rss_mib()
    pl.seed_everything(0, verbose=False)
    strategy = _strategy(layout)
    deepspeed_load = folder if folder and LAYOUTS[layout][0] == "deepspeed" else None
    module = decoder_class()(config, build, deepspeed_load)
    probe = probe_callback()
    callbacks = [probe] + ([HuggingFaceWeights(folder)] if folder and not deepspeed_load else [])
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=callbacks, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=_batches(config["vocab_size"], 1))
    return {"baseline": baseline, "baseline_now": baseline_now, **probe.values}


def save_folder(rank: int, world: int, config: dict, folder: str) -> float:
    """Write the decoder once (one process, random weights) with ``save_pretrained``; returns its bytes in MiB."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.save_pretrained(folder)
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) / 2**20


def full_mib(config: dict) -> float:
    """The decoder's parameters and buffers in MiB (fp32), counted on ``meta``."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20


def measure_one(layout: str, config: dict, build: str, init: str, folder: str | None, full: float) -> dict:
    """One row: every rank's numbers and the maxima the table shows."""
    from lightning_parallel.testing import run_processes

    start = time.perf_counter()
    try:
        ranks = run_processes(rank_run, WORLD, layout, config, build, folder, timeout=1800)
    except Exception as error:  # noqa: BLE001 - a layout that fails is a row with its error, not a lost run
        return {"layout": layout, "init": init, "build": build, "error": str(error)[-2000:]}
    share = full / WORLD
    setup = max(r["setup_peak"] - r["baseline"] for r in ranks)
    step = max(r["step_peak"] - r["baseline"] for r in ranks)
    return {"layout": layout, "init": init, "build": build, "full_mib": full, "share_mib": share,
            "setup_added_mib": setup, "setup_ratio": setup / share, "step_added_mib": step,
            "step_ratio": step / share, "held_mib": [r["held_mib"] for r in ranks],
            "baseline_mib": [r["baseline"] for r in ranks], "ranks": ranks,
            "loss": ranks[-1].get("loss"), "wall_s": time.perf_counter() - start}


def render(rows: list[dict]) -> str:
    """The markdown table."""
    lines = ["| layout | init | build | full MiB | ideal share MiB | setup peak added MiB (max rank) | / share | "
             "held params MiB (per rank) | after 1st step added MiB | / share |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['init']} | {r['build']} | failed: "
                         f"{r['error'].strip().splitlines()[-1][:150]} | | | | | | |")
            continue
        held = " / ".join(f"{h:.0f}" for h in r["held_mib"])
        ratio = (lambda x: f"{x:.2f}x") if r["share_mib"] >= 1 else (lambda x: "-")  # the calibration's tiny share
        size = (lambda x: f"{x:.0f}") if r["share_mib"] >= 1 else (lambda x: f"{x:.2f}")
        lines.append(f"| {r['layout']} | {r['init']} | {r['build']} | {size(r['full_mib'])} | {size(r['share_mib'])} | "
                     f"{r['setup_added_mib']:.0f} | {ratio(r['setup_ratio'])} | {held} | "
                     f"{r['step_added_mib']:.0f} | {ratio(r['step_ratio'])} |")
    return "\n".join(lines)


def measure(layouts: list[str], inits: list[str], builds: list[str], config: dict, tmp: Path) -> list[dict]:
    """Every (layout, init, build) in fresh processes; the pretrained folder is written once, first."""
    from lightning_parallel.testing import run_processes

    full = full_mib(config)
    folder = None
    if "pretrained" in inits:
        folder = str(tmp / "pretrained")
        saved = run_processes(save_folder, 1, config, folder, timeout=1800)[0]
        print(f"[setup_memory] saved {saved:.0f} MiB to {folder}", flush=True)
    rows = []
    for init in inits:
        for layout in layouts:
            for build in builds:
                row = measure_one(layout, config, build, init, folder if init == "pretrained" else None, full)
                rows.append(row)
                print("[setup_memory] " + render([row]).splitlines()[-1], flush=True)
    return rows


def main() -> None:
    import tempfile

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--inits", nargs="+", default=["random", "pretrained"], choices=["random", "pretrained"])
    parser.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    parser.add_argument("--small", action="store_true", help="a ~190 MiB decoder instead of the ~1 GiB one")
    parser.add_argument("--calibrate", action="store_true", help="also the tiny decoder: the size-free overhead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    parser.add_argument("--name", default="setup_memory", help="file stem of the results (.json, .md)")
    parser.add_argument("--note", default="", help="a line saying what this run measured (kept in both files)")
    args = parser.parse_args()
    config = SMALL if args.small else MODEL
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args.layouts, args.inits, args.builds, config, Path(tmp))
    calibration = measure(args.layouts, ["random"], ["configure_model"], TINY, Path(".")) if args.calibrate else []
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": config, "tiny": TINY, "seq": SEQ, "batch": BATCH, "world": WORLD, "torch": torch.__version__,
            "runtime_s": time.perf_counter() - start, "how": HOW, "note": args.note, "commit": _commit()}
    (args.out / f"{args.name}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "calibration": calibration}, indent=2))
    text = f"# Setup memory per rank\n\n{args.note}\n\n{HOW}\n\n{render(rows)}\n".replace("\n\n\n", "\n\n")
    if calibration:
        text += f"\nCalibration (tiny decoder, {full_mib(TINY):.2f} MiB): what a rank adds whatever the model size.\n\n"
        text += render(calibration) + "\n"
    (args.out / f"{args.name}.md").write_text(text)
    print(text)
    print(f"[setup_memory] wrote {args.out}/{args.name}.json and .md in {meta['runtime_s']:.0f} s")


def _commit() -> str:
    """The checkout's commit, ``+`` when the working tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    return commit + ("+" if commit and git("status", "--porcelain", "--untracked-files=no") else "")


if __name__ == "__main__":
    main()
