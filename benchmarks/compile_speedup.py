"""Step time of compiled blocks (``compile=True``, inductor) against eager, on the same processes and data.

    python -m benchmarks.compile_speedup                         # single and pp2 x tp2
    python -m benchmarks.compile_speedup --layouts single --steps 10 --out /tmp/compile

The benchmark GPT (``benchmarks/conf/config.yaml``: seq 64, d 128, 4 blocks, 4 heads; no dropout, so both runs
see the same computation) is parallelised twice in the same processes by
:func:`~lightning_parallel.parallel.compose.parallelize`, once eager and once with every layer compiled, and both are
trained by the same raw loop (the pipeline runner under pipelining, 4 micro-batches, 1F1B) with AdamW from the same
initialisation on the same batches. The two take turns step by step, so a change in the machine's load affects both
alike. Compilation happens in the warm-up steps (its wall time is reported); step time is the slowest rank's; the
speed-up is the median over rounds of eager step / compiled step of the same round. Parity: the largest difference
between the two runs' losses over all steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

MODES = ("eager", "compiled")
LAYOUTS = {"single": (1, 1, 1), "pp2xtp2": (1, 2, 2)}  # name -> (data, pipeline, tensor)
MODEL = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4, "dropout": 0.0}
BATCH, MICROBATCHES, WARMUP = 16, 4, 2


def _build(rank: int, world_size: int, sizes: tuple, compiled: bool) -> tuple:
    """One GPT parallelised eager or compiled: ``(module, step function, optimizer)``."""
    from benchmarks.activation_memory import raw_train_step
    from examples.nlp.model import GPT
    from lightning_parallel.adapters import adapt
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.layout.meshes import RunMeshes
    from lightning_parallel.parallel.compose import parallelize
    from lightning_parallel.parallel.options import ParallelOptions

    layout = ParallelLayout(world_size, *sizes)
    options = ParallelOptions(*sizes, microbatches=MICROBATCHES, schedule="1f1b", compile=compiled)
    torch.manual_seed(0)
    module = GPT(**MODEL).build()
    meshes = RunMeshes.build(layout, "cpu", options.zero_stage)
    mesh = meshes.run
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    return module, raw_train_step(module, result, mesh), torch.optim.AdamW(module.parameters(), lr=1e-3)


def _rank(rank: int, world_size: int, sizes: tuple, steps: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps + WARMUP, BATCH, MODEL["seq_len"] + 1), generator=g)
    runs = {mode: _build(rank, world_size, sizes, mode == "compiled") for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    losses: dict[str, list[float]] = {mode: [] for mode in MODES}
    warmup: dict[str, float] = {mode: 0.0 for mode in MODES}
    for index in range(steps + WARMUP):
        for mode, (_, step, optimizer) in runs.items():
            x, y = tokens[index, :, :-1], tokens[index, :, 1:]
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            loss = step(x, y)
            optimizer.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
            if index < WARMUP:
                warmup[mode] += float(elapsed)
            else:
                times[mode].append(float(elapsed))
            losses[mode].append(float(loss) if loss is not None else float("nan"))
    return {"step_s": times, "losses": losses, "warmup_s": warmup}


def measure(layouts: list[str], steps: int, timeout: float = 1800) -> list[dict]:
    """One row per layout: median step eager and compiled, the speed-up, compile (warm-up) time and loss parity.

    Args:
        layouts: keys of :data:`LAYOUTS`.
        steps: timed steps per mode (after :data:`WARMUP` untimed ones, where compilation happens).
        timeout: seconds per layout.
    """
    import math

    from lightning_parallel.testing import run_processes

    rows = []
    for name in layouts:
        sizes = LAYOUTS[name]
        world = math.prod(sizes)
        per_rank = run_processes(_rank, world, sizes, steps, timeout=timeout)
        times = per_rank[0]["step_s"]  # the slowest rank's, the same on every rank
        # The loss is known on the last pipeline stage's ranks (nan elsewhere): compare where both have one.
        diffs = [abs(a - b) for r in per_rank for a, b in zip(r["losses"]["eager"], r["losses"]["compiled"])
                 if not (math.isnan(a) or math.isnan(b))]
        rows.append({"layout": name, "world": world,
                     "eager_ms": 1e3 * statistics.median(times["eager"]),
                     "compiled_ms": 1e3 * statistics.median(times["compiled"]),
                     "speedup": statistics.median(a / b for a, b in zip(times["eager"], times["compiled"])),
                     "warmup_s": per_rank[0]["warmup_s"], "max_loss_diff": max(diffs) if diffs else float("nan"),
                     "steps_s": times})
        print(f"[compile_speedup] {name}: " + render_rows(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def render_rows(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`measure`'s rows."""
    lines = ["| layout | processes | eager ms | compiled ms | eager / compiled | warm-up s eager / compiled "
             "| max loss diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['world']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                     f"{r['speedup']:.3f} | {r['warmup_s']['eager']:.1f} / {r['warmup_s']['compiled']:.1f} | "
                     f"{r['max_loss_diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode (after the warm-up steps)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = measure(args.layouts, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "batch": BATCH, "microbatches": MICROBATCHES, "steps": args.steps, "warmup": WARMUP,
            "runtime_s": time.perf_counter() - start, "torch": torch.__version__}
    (args.out / "compile_speedup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "compile_speedup.md").write_text(__doc__.split("\n\n", 2)[2] + "\n" + render_rows(rows) + "\n")
    print(render_rows(rows))
    print(f"[compile_speedup] wrote {args.out}/compile_speedup.json and .md in {meta['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
