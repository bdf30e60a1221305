"""Data-axis communication per layout on 4 processes: bytes per mesh axis and exposed communication time.

``python -m benchmarks.data_axis_comm [--steps 20] [--width 256] [--depth 8]`` trains the
residual MLP with raw loops over :func:`~lightning_parallel.parallel.compose.parallelize` and
compares, on the same ranks and batches:

* ``dp4 overlap``: ``zero_stage=0`` as :func:`parallelize` builds it alone, torch's DDP -- gradients
  all-reduced during backward in 25 MB buckets (``, per layer``: ``bucket_size_mb=0``); DDP's reducer
  calls the process group from C++, so these two rows count no bytes (they move what the FSDP2 row moves);
* ``dp4 overlap, FSDP2``: the same axis on FSDP2 (a 4 x 1 mesh, buckets of layers), the form it takes
  beside a pipeline and took alone before;
* ``dp4 after backward``: the same replicas, gradients all-reduced in one flat bucket once
  backward has returned (the hand-written reduction this suite used before; overlap off);
* ``dp4 zero2``: FSDP2 sharding over the whole data axis, one unit per layer (``, 25 MB units``:
  ``bucket_size_mb=25``, layers grouped into units of that size: fewer all-gathers and reduce-scatters);
* ``hsdp 2x2 zero2``: FSDP2 sharding within pairs, all-reduce across them.

Measured per layout, per rank, then the median over ranks:

* bytes per step on each mesh axis (``data_parallel``, ``data_shard``, ``data_replicate``): every
  ``torch.distributed`` collective of one step is logged with its group and its input's bytes
  (the payload on the calling rank, as :mod:`benchmarks.comm` counts; not wire bytes);
* exposed communication: median forward + backward (+ the reduction after it, when overlap is
  off) minus the median of the same forward + backward with no communication (the unwrapped
  module on this rank's batch); all layouts and the compute-only module step round-robin in
  one process group, so machine noise hits every side alike;
  the optimizer step is timed apart (FSDP2's parameters are DTensors: the step pays DTensor
  dispatch, which is no communication).

On CPU with gloo the collectives run on the same cores as the compute, so "overlap" can hide
little here; the bytes are exact anywhere, the times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# torch.distributed function -> (position, keyword) of the input tensor whose bytes are counted. FSDP2 in
# torch 2.13 calls the *_single forms (benchmarks/comm.py's list predates them).
COUNTED = {"all_reduce": (0, "tensor"), "all_gather_single": (1, "input_tensor"), "reduce_scatter_single": (1, "input"),
           "all_gather_into_tensor": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input")}
LAYOUTS = {
    "dp4 overlap": {"zero_stage": 0},
    "dp4 overlap, per layer": {"zero_stage": 0, "bucket_size_mb": 0},
    "dp4 overlap, FSDP2": {"fsdp2": True},
    "dp4 after backward": {"zero_stage": 0, "after_backward": True},
    "dp4 zero2": {"zero_stage": 2},
    "dp4 zero2, 25 MB units": {"zero_stage": 2, "bucket_size_mb": 25},
    "hsdp 2x2 zero2": {"zero_stage": 2, "data_replicate": 2},
}


@contextmanager
def bytes_per_axis(axes: dict[str, tuple[int, ...]], out: Counter) -> Iterator[None]:
    """Add each counted collective's input bytes to ``out[axis]`` (the axis whose ranks form its group)."""
    saved = {name: getattr(dist, name) for name in COUNTED}

    def counted(name: str, original: Callable) -> Callable:
        position, keyword = COUNTED[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            source = args[position] if len(args) > position else kwargs[keyword]
            group = kwargs.get("group")
            if group is not None:
                ranks = tuple(dist.get_process_group_ranks(group))
            else:
                ranks = tuple(range(dist.get_world_size()))
            if len(ranks) == 1:
                axis = "group of 1 (a copy)"
            else:
                axis = next((a for a, r in axes.items() if r == ranks), str(ranks))
            out[axis] += source.numel() * source.element_size()
            return original(*args, **kwargs)
        return call

    for name, original in saved.items():
        setattr(dist, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _flat_all_reduce(module: torch.nn.Module, group: Any) -> None:
    """Overlap off: one all-reduce of every gradient, flattened, after backward."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _build(rank: int, spec: dict, width: int, depth: int) -> dict:
    """One layout on this rank: its module, optimizer, reduction group and the axes its groups belong to."""
    from lightning_parallel.adapters import adapt
    from lightning_parallel.layout import DATA_PARALLEL, DATA_REPLICATE, DATA_SHARD, ParallelLayout
    from lightning_parallel.layout.meshes import RunMeshes
    from lightning_parallel.parallel.compose import parallelize
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.testing.models import ResidualMLP

    world = dist.get_world_size()
    layout = ParallelLayout(world, world, 1, 1, data_replicate=spec.get("data_replicate", 1))
    meshes = RunMeshes.build(layout, "cpu", spec.get("zero_stage") or 0)
    torch.manual_seed(0)
    module = ResidualMLP(width=width, depth=depth)
    group = meshes.group(DATA_PARALLEL) if spec.get("after_backward") else None
    wrapper = module
    if spec.get("fsdp2"):  # the FSDP2 form of zero_stage=0 (what parallelize built alone before; beside a pipeline now)
        from lightning_parallel.parallel.data import data_axis_mesh, shard_data_axis

        dp_mesh = data_axis_mesh(layout, 0, meshes.run, meshes.data)
        shard_data_axis(module.pipeline_layers(), [module], dp_mesh, 0,
                        bucket_bytes=ParallelOptions(data_parallel_size=world).bucket_bytes)
    elif spec.get("zero_stage") is not None and group is None:
        options = ParallelOptions(data_parallel_size=world, zero_stage=spec["zero_stage"],
                                  bucket_size_mb=spec.get("bucket_size_mb"))
        # Alone, zero_stage=0 is torch's DDP around the module: the step runs through that wrapper.
        wrapper = parallelize(module, meshes=meshes, options=options, adapter=adapt(module)).replicated or module
    axes = {DATA_PARALLEL: tuple(layout.group_ranks(DATA_PARALLEL, rank))}
    if layout.hsdp_enabled:
        axes.update({a: tuple(layout.group_ranks(a, rank)) for a in (DATA_SHARD, DATA_REPLICATE)})
    return {
        "module": module,
        "forward": wrapper,
        "optimizer": torch.optim.AdamW(module.parameters(), lr=1e-3),
        "group": group,
        "axes": axes,
    }


def _step(run: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(forward + backward + gradient reduction, optimizer step) seconds of one step of ``run``."""
    module, optimizer = run["module"], run["optimizer"]
    start = time.perf_counter()
    module.pipeline_loss(run["forward"](x), y).backward()
    if run["group"] is not None:
        _flat_all_reduce(module, run["group"])
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return middle - start, time.perf_counter() - middle


def _worker(rank: int, world_size: int, width: int, depth: int, steps: int) -> dict:
    """Every layout and the compute-only module, stepped round-robin (A B C D E A B ...) under the same load."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    runs = {name: _build(rank, spec, width, depth) for name, spec in {**LAYOUTS, "compute only": {}}.items()}
    x, y = torch.randn(8, width), torch.randn(8, width)
    counted = {name: Counter() for name in LAYOUTS}
    for name in LAYOUTS:
        with bytes_per_axis(runs[name]["axes"], counted[name]):
            _step(runs[name], x, y)
    times: dict[str, list] = {name: [] for name in runs}
    for _ in range(steps):
        for name, run in runs.items():
            dist.barrier()
            times[name].append(_step(run, x, y))

    def median_ms(name: str, part: int) -> float:
        return 1e3 * statistics.median(t[part] for t in times[name][2:])

    return {name: {"bytes": dict(counted[name]), "step_ms": median_ms(name, 0),
                   "compute_ms": median_ms("compute only", 0),
                   "optimizer_ms": median_ms(name, 1), "plain_optimizer_ms": median_ms("compute only", 1)}
            for name in LAYOUTS}


def summarise(per_rank: list[dict]) -> list[dict]:
    """One row per layout: median over ranks of bytes per axis, step, compute and exposed communication."""
    rows = []
    for name in LAYOUTS:
        runs = [r[name] for r in per_rank]
        axes = sorted({a for run in runs for a in run["bytes"]})
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "bytes"}
        rows.append({"layout": name, **{f"MB/step {a}": statistics.median(r["bytes"].get(a, 0) for r in runs) / 2**20
                                        for a in axes},
                     "fwd+bwd+reduce ms": med["step_ms"], "fwd+bwd alone ms": med["compute_ms"],
                     "exposed comm ms": med["step_ms"] - med["compute_ms"],
                     "optimizer ms": med["optimizer_ms"], "plain optimizer ms": med["plain_optimizer_ms"]})
    return rows


def main() -> None:
    from lightning_parallel.testing import run_processes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    per_rank = run_processes(_worker, 4, args.width, args.depth, args.steps, timeout=1800)
    rows = summarise(per_rank)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_axis_comm.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2)
    )
    for row in rows:
        print(" | ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
