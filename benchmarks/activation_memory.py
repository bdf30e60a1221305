"""Peak activation memory and step time per rank with activation checkpointing off, selective and full.

    python -m benchmarks.activation_memory                      # pp2, tp2, dp2 x pp2 ZeRO-3
    python -m benchmarks.activation_memory --layouts pp2 --steps 3 --out /tmp/ac

The GPT recipe scaled so that activations dominate (sequence 256, 8 blocks, width 64,
dropout 0.1: the attention scores, ``batch x heads x 256 x 256`` per block, outweigh the
weights ~100x) is parallelised by :func:`~lightning_parallel.parallel.compose.parallelize`
once per mode in the same processes, and trained by raw loops (the pipeline runner under
pipelining). The modes take turns step by step (none, selective, full, none, ...), so a
change in the machine's load affects them alike.

Memory, on CPU: :class:`LiveTensorBytes` follows every tensor storage created by an
operation during one training step (forward and backward) and sums the bytes of those still
alive after each operation; the peak of that sum over the step, per rank, is reported. It
counts what the step allocates -- saved activations, inputs held by checkpointed layers,
recomputed activations, gradients, transient buffers, FSDP2's gathered parameters -- and
not the memory held before the step (weights, optimizer state). A storage is counted until
it is freed, however it is referenced (views, autograd's saved tensors, the checkpoint's
saved inputs), which hooks on saved tensors alone would miss: checkpointing replaces them
inside each recomputed region. Step time: the slowest rank's, median over the timed steps; the
time ratio of a mode is the median over rounds of its step over the ``none`` step of the same round;
the CPU-time ratio divides the median CPU seconds per step of the busiest rank (``process_time``),
which other work on a shared machine does not inflate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MODES = ("none", "selective", "full")
HOW = ("How: the GPT recipe scaled so activations dominate (seq 256, 8 blocks, d 64, 4 heads, dropout 0.1, global "
       "batch 8, 4 micro-batches, 1F1B) is parallelised once per mode in the same processes; the modes take turns "
       "step by step. Memory: peak bytes of the tensor storages a training step (forward + backward) creates and "
       "still holds (a dispatch mode follows every storage until it is freed; weights and optimizer state held "
       "before the step do not count), per rank. Time: median step of the slowest rank. Cut = peak of `none` / "
       "peak of the mode (max over ranks); time ratio = median over rounds of mode step / `none` step of the same "
       "round; CPU-time ratio = "
       "median CPU seconds per step (busiest rank, `process_time`) of the mode / of `none`, insensitive to the "
       "shared machine's load.")
# name -> ((data, pipeline, tensor) sizes, zero_stage)
LAYOUTS = {"pp2": ((1, 2, 1), 0), "tp2": ((1, 1, 2), 0), "dp2xpp2_zero3": ((2, 2, 1), 3),
           "single": ((1, 1, 1), 0)}  # one process: the recompute cost without communication or waiting
MODEL = {"vocab_size": 256, "seq_len": 256, "d_model": 64, "n_layer": 8, "n_head": 4, "dropout": 0.1}
BATCH, MICROBATCHES = 8, 4


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the storages created by operations while active and still alive (one process).

    Args:
        exclude: tensors whose storages existed before and must not count (weights, gradients).
    """

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        super().__init__()
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}
        self._excluded = {_storage_key(t) for t in exclude}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(_local(t).untyped_storage())
        # Current sizes, not sizes at creation: FSDP2 frees gathered parameters by resizing their storage.
        self.peak = max(self.peak, sum(s().nbytes() for s in list(self._live.values()) if s() is not None))
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # the Python storage object lives exactly as long as the storage itself
        if key in self._excluded or key in self._live:
            return
        self._live[key] = weakref.ref(storage, lambda _, key=key: self._live.pop(key, None))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> int:
    return id(_local(t).untyped_storage())


def _build(rank: int, world_size: int, sizes: tuple, zero_stage: int, mode: str, dropout: float) -> tuple:
    """One GPT parallelised for ``mode``: ``(module, step function, optimizer)``."""
    from examples.nlp.model import GPT
    from lightning_parallel.adapters import adapt
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.layout.meshes import RunMeshes
    from lightning_parallel.parallel.compose import parallelize
    from lightning_parallel.parallel.options import ParallelOptions

    layout = ParallelLayout(world_size, *sizes)
    options = ParallelOptions(*sizes, zero_stage=zero_stage, microbatches=MICROBATCHES, schedule="1f1b",
                              partition="uniform", activation_checkpointing=mode)
    torch.manual_seed(0)
    module = GPT(**{**MODEL, "dropout": dropout}).build()
    meshes = RunMeshes.build(layout, "cpu", options.zero_stage)
    mesh = meshes.run
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    step = raw_train_step(module, result, mesh)
    share = BATCH // layout.data_parallel
    start = layout.coordinates(rank).data * share
    return module, step, torch.optim.AdamW(module.parameters(), lr=1e-3), slice(start, start + share)


def raw_train_step(module: torch.nn.Module, result: Any, mesh: Any) -> Any:
    """``(x, y) -> loss`` running forward and backward of a parallelised module: the pipeline runner (cpu, its
    options' schedule and micro-batches) when it was cut into stages, its DDP wrapper where the data axis is DDP,
    else ``module`` itself (``result``: what
    :func:`~lightning_parallel.parallel.compose.parallelize` returned; ``mesh``: the run's mesh)."""
    from lightning_parallel.layout import PIPELINE_PARALLEL
    from lightning_parallel.parallel.pipeline.runner import PipelineRunner

    if result.pipelined:
        options = result.options
        return PipelineRunner(result.stages, result.stage_ids, result.num_stages, options.schedule,
                              options.microbatches, loss_fn=module.pipeline_loss, device=torch.device("cpu"),
                              group=mesh[PIPELINE_PARALLEL].get_group(),
                              last_stage_rank=result.last_stage_rank).train_step

    forward = result.replicated or module  # data alone under ZeRO 0 is torch's DDP: its wrapper reduces gradients

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = module.pipeline_loss(forward(x), y)
        loss.backward()
        return loss

    return step


def _rank(rank: int, world_size: int, sizes: tuple, zero_stage: int, steps: int, dropout: float) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"] + 1), generator=g)
    runs = {mode: _build(rank, world_size, sizes, zero_stage, mode, dropout) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    peaks: dict[str, int] = {}
    for index in range(steps + 2):  # one warm-up step, one measured for memory, then the timed steps
        for mode, (module, step, optimizer, share) in runs.items():
            x, y = tokens[share, :-1], tokens[share, 1:]
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            if index == 1:
                held = [p for p in module.parameters()] + [b for b in module.buffers()]
                with LiveTensorBytes(held) as counter:
                    step(x, y)
                peaks[mode] = counter.peak
            else:
                start, start_cpu = time.perf_counter(), time.process_time()
                step(x, y)
                elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
                if index >= 2:
                    times[mode].append(float(elapsed[0]))
                    cpu[mode].append(float(elapsed[1]))
            optimizer.step()
    return {"peak_bytes": peaks, "step_s": times, "cpu_s": cpu}


def measure(layouts: list[str], steps: int, dropout: float = MODEL["dropout"], timeout: float = 1800) -> list[dict]:
    """Every layout of ``layouts`` (keys of :data:`LAYOUTS`): one row per layout with per-rank peaks and step medians.

    Args:
        layouts: keys of :data:`LAYOUTS`.
        steps: timed steps per mode (after one warm-up and one memory step).
        dropout: the model's dropout (random masks are recomputed too, which costs on CPU).
        timeout: seconds per layout.
    """
    from lightning_parallel.testing import run_processes

    rows = []
    for name in layouts:
        sizes, zero_stage = LAYOUTS[name]
        world = sizes[0] * sizes[1] * sizes[2]
        per_rank = run_processes(_rank, world, sizes, zero_stage, steps, dropout, timeout=timeout)
        row: dict[str, Any] = {"layout": name, "world": world}
        times, cpu = per_rank[0]["step_s"], per_rank[0]["cpu_s"]  # the slowest rank's, the same on every rank
        for mode in MODES:
            row[mode] = {"peak_bytes_per_rank": [r["peak_bytes"][mode] for r in per_rank],
                         "step_s": statistics.median(times[mode]), "steps_s": times[mode]}
        for mode in ("selective", "full"):
            row[f"{mode}_memory_cut"] = max(row["none"]["peak_bytes_per_rank"]) / max(row[mode]["peak_bytes_per_rank"])
            # Median of the ratios within a round (none, selective, full back to back): load that changes
            # between rounds cancels.
            row[f"{mode}_time_ratio"] = statistics.median(a / b for a, b in zip(times[mode], times["none"]))
            # CPU seconds of the busiest rank: what recomputation costs, whatever else runs on the machine.
            row[f"{mode}_cpu_ratio"] = statistics.median(cpu[mode]) / statistics.median(cpu["none"])
        rows.append(row)
        print(f"[activation_memory] {name}: " + render_rows([row]).splitlines()[-1], flush=True)
    return rows


def render_rows(rows: list[dict]) -> str:
    """A markdown table: peak MiB per rank and step time per mode, with the ratios to ``none``."""
    mib = lambda values: " / ".join(f"{v / 2**20:.1f}" for v in values)  # noqa: E731
    lines = ["| layout | none MiB/rank | selective MiB/rank | full MiB/rank | none s | selective s | full s | "
             "memory cut selective / full | step time selective / full | CPU time selective / full |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {mib(r['none']['peak_bytes_per_rank'])} | "
            f"{mib(r['selective']['peak_bytes_per_rank'])} | "
            f"{mib(r['full']['peak_bytes_per_rank'])} | {r['none']['step_s']:.3f} | {r['selective']['step_s']:.3f} | "
            f"{r['full']['step_s']:.3f} | {r['selective_memory_cut']:.2f}x / {r['full_memory_cut']:.2f}x | "
            f"{r['selective_time_ratio']:.2f}x / {r['full_time_ratio']:.2f}x | "
            f"{r['selective_cpu_ratio']:.2f}x / {r['full_cpu_ratio']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> Path:
    """Bars of the peak MiB (busiest rank) and of the step-time ratio to ``none``, per layout and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (memory, time_ratio) = plt.subplots(1, 2, figsize=(11, 3.6))
    x = range(len(rows))
    for offset, mode in zip((-0.27, 0.0, 0.27), MODES):
        peaks = [max(r[mode]["peak_bytes_per_rank"]) / 2**20 for r in rows]
        memory.bar([i + offset for i in x], peaks, 0.27, label=mode)
        ratios = [1.0 if mode == "none" else r[f"{mode}_time_ratio"] for r in rows]
        time_ratio.bar([i + offset for i in x], ratios, 0.27, label=mode)
    memory.set_ylabel("peak MiB (busiest rank)")
    time_ratio.set_ylabel("step time / none")
    time_ratio.axhline(1.4, color="grey", linestyle="--", linewidth=0.8)
    for ax in (memory, time_ratio):
        ax.set_xticks(list(x), [r["layout"] for r in rows], rotation=20, ha="right", fontsize=7)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["pp2", "tp2", "dp2xpp2_zero3"], choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode (after a warm-up and a memory step)")
    parser.add_argument("--dropout", type=float, default=MODEL["dropout"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = measure(args.layouts, args.steps, args.dropout)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": {**MODEL, "dropout": args.dropout}, "batch": BATCH, "microbatches": MICROBATCHES,
            "steps": args.steps, "runtime_s": time.perf_counter() - start, "torch": torch.__version__}
    (args.out / "activation_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "activation_memory.md").write_text(
        render_rows(rows) + "\n\n![activation memory](activation_memory.png)\n"
    )
    plot(rows, args.out / "activation_memory.png")
    print(render_rows(rows))
    print(f"[activation_memory] wrote {args.out}/activation_memory.json and .md in {meta['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
