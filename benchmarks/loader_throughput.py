"""Input throughput against step throughput for the three data modules of your own data (docs/your-data.md).

    python -m benchmarks.loader_throughput            # 2 and 4 processes
    python -m benchmarks.loader_throughput --quick    # 2 processes

Each recipe runs data-parallel on R processes (gloo) on data this script writes: ``data=hf_text`` (a tiny Llama,
width 64, on 3,000 packed JSONL/text documents, rows of 128 tokens, 8 rows per rank), ``data=image_folder`` (a ViT of
width 64 on 300 PNGs of 64 x 64 read at 32 x 32, 32 images per rank; decoding each file when read in 2 workers per rank,
and from the decoded cache, ``cache_size=40``, in the rank's process) and the Criteo TSV
(TorchRec's DLRM, 26 tables, table-wise, 20,000 lines, 256 lines per rank). In every rank, at the same time:

* loader samples/s: the rank's own training loader (its shard, its workers) drawing 20 batches after one;
* step samples/s: the same batch size through the training step (``on_train_batch_start`` to ``on_train_batch_end``:
  forward, backward, gradient reduction, optimizer), median of the steps after two.

The loader must keep up with the step with margin: the ratio (the slowest rank's) should be >= 2. This machine has 2
cores shared by every rank and worker (and by other jobs), so absolute rates are low and noisy; the ratio is what to
read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import date
from functools import partial
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.step_times import StepTimes
from lightning_parallel.testing import run_processes

LOADER_BATCHES, STEPS, WARMUP = 20, 10, 2
RECIPES = ("hf_text", "image_folder", "image_folder_cached", "criteo")


def write_data(root: Path) -> dict[str, str]:
    """The corpus and tiny Llama, the image folder and the Criteo TSV (once, before the ranks start)."""
    from tests.distributed.examples.test_criteo_torchrec import write_criteo
    from tests.distributed.examples.test_image_folder_layouts import write_image_folder
    from tests.hf_text_corpus import save_model, train_tokenizer, write_corpus

    corpus = write_corpus(root / "text", records=3000, texts=30)
    tokenizer = train_tokenizer([corpus["jsonl"], corpus["texts"]], root / "tokenizer")
    save_model(root / "llama", tokenizer)
    images = write_image_folder(root / "images", classes=3, per_class=100)
    criteo = write_criteo(root / "day_0.tsv", lines=20_000)
    return {"jsonl": str(corpus["jsonl"]), "texts": str(corpus["texts"]), "llama": str(root / "llama"),
            "images": str(images), "criteo": str(criteo), "cache": str(root / "cache")}


def build(recipe: str, paths: dict[str, str]) -> tuple[pl.LightningModule, pl.LightningDataModule, Any, int]:
    """(model, data, strategy, batch size per rank) of one recipe."""
    from lightning_parallel.strategies import HybridParallelStrategy

    torch.manual_seed(0)
    data_parallel = HybridParallelStrategy(pipeline_parallel_size=1, tensor_parallel_size=1)
    if recipe == "hf_text":
        from examples.nlp.hf_causal_lm import HFCausalLM
        from examples.nlp.hf_text import HFTextDataModule

        data = HFTextDataModule(files=[paths["jsonl"], paths["texts"]], tokenizer=paths["llama"], seq_len=128,
                                batch_size=8, cache_dir=paths["cache"])
        overrides = {"hidden_size": 64, "intermediate_size": 128}
        model = HFCausalLM(config=paths["llama"], config_overrides=overrides, vocab_size=None)
        return model, data, data_parallel, 8
    if recipe.startswith("image_folder"):
        from examples.vision.image_folder import ImageFolderDataModule
        from examples.vision.model import ViT

        # Decoding files: 2 workers per rank; from the decoded cache: in the rank's own process (cheap enough, and
        # on 2 cores more processes only compete).
        cached = recipe.endswith("cached")
        options = {"cache_size": 40, "cache_dir": paths["cache"], "num_workers": 0} if cached else {"num_workers": 2}
        data = ImageFolderDataModule(paths["images"], image_size=32, num_classes=3, batch_size=32, **options)
        model = ViT(image_size=32, patch_size=4, in_channels=3, num_classes=3, d_model=64, n_layer=2, n_head=4,
                    mlp_ratio=2, optimizer=partial(torch.optim.AdamW, lr=1e-3))
        return model, data, data_parallel, 32
    from examples.recsys.criteo import CriteoClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy
    from tests.distributed.examples.test_criteo_torchrec import TABLE_SIZES

    data = CriteoClickDataModule(paths["criteo"], TABLE_SIZES, batch_size=256)
    model = TorchRecDLRM(num_dense=13, table_sizes=TABLE_SIZES, embedding_dim=16, bottom_widths=(64,),
                         top_widths=(64, 32))
    return model, data, TorchRecStrategy(sharding="table_wise"), 256


def loader_rate(data: pl.LightningDataModule, rank: int, world_size: int, batch_size: int) -> float:
    """Samples/s of this rank's training loader (its shard), after one batch."""
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(
        distributed_sampler_kwargs={"num_replicas": world_size, "rank": rank}))
    data.setup("fit")
    iterator = iter(data.train_dataloader())
    next(iterator)
    start = time.perf_counter()
    drawn = sum(1 for _ in islice(iterator, LOADER_BATCHES))
    data.trainer = None
    return drawn * batch_size / (time.perf_counter() - start)


def measure(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, dict[str, float]]:
    """Rank function: loader and step samples/s of every recipe on this rank."""
    import torch.distributed as dist

    out = {}
    for recipe in RECIPES:
        model, data, strategy, batch_size = build(recipe, paths)
        times = StepTimes()
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS + WARMUP,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
                             callbacks=[times])
        trainer.fit(model, datamodule=data)  # the process group first: the loaders are then timed side by side
        dist.barrier()
        loader = loader_rate(data, rank, world_size, batch_size)
        dist.barrier()
        step = batch_size / statistics.median(times.times[WARMUP:])
        out[recipe] = {"loader_samples_per_s": loader, "step_samples_per_s": step, "ratio": loader / step}
    return out


def table(results: dict[int, list[dict]]) -> str:
    """The markdown table: per recipe and process count, the slowest rank's ratio."""
    rows = ["| recipe | processes | loader samples/s per rank | step samples/s per rank "
            "| loader / step (slowest rank) |",
            "|---|---|---|---|---|"]
    for recipe in RECIPES:
        for world_size, per_rank in sorted(results.items()):
            loader = min(r[recipe]["loader_samples_per_s"] for r in per_rank)
            step = max(r[recipe]["step_samples_per_s"] for r in per_rank)
            ratio = min(r[recipe]["ratio"] for r in per_rank)
            rows.append(f"| {recipe} | {world_size} | {loader:,.0f} | {step:,.0f} | {ratio:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 processes only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        paths = write_data(Path(folder))
        results = {n: run_processes(measure, n, paths, timeout=1200) for n in ((2,) if args.quick else (2, 4))}
    text = table(results)
    print(text)
    out = Path(__file__).parent / "results" / date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    (out / "loader_throughput.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    (out / "loader_throughput.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
