"""Measured pipeline bubble (idle fraction per rank, from timestamps) and peak activation memory per schedule.

    python -m benchmarks.pipeline_bubble --stages 2 --microbatches 4 8 --steps 4

Each schedule runs the GPT recipe's layers split into stages by the library's own
machinery (``split_module`` + ``PipelineRunner``); a :class:`StageTimeline` records every
forward (F), backward (B; input-gradient for zero-bubble) and weight-gradient (W) action on
every rank. The idle fraction of a rank is the share of the step window (first start to
last end over all ranks) in which it computed nothing: the bubble plus send/recv and
Python overhead. Efficiency is 1 - mean idle. Medians over steps after one warm-up step.

Peak activation memory: the largest total size of tensors that autograd keeps saved for
backward at any moment of the step, tracked with ``torch.autograd.graph.saved_tensors_hooks``
(each saved tensor is counted once per storage, from when forward saves it until backward
frees it; parameters are excluded). It is exact for what autograd holds and ignores
transient buffers, which an RSS delta could not separate from allocator noise.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn

# schedule -> stages per rank (v)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv": 2}


class SavedActivations:
    """Tracks the live bytes of tensors saved for backward, and their peak (one process)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._params: set[int] = set()

    def exclude(self, module: nn.Module) -> None:
        """Do not count ``module``'s parameters (weights saved for backward are not activations)."""
        self._params |= {p.untyped_storage().data_ptr() for p in module.parameters()}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        tracker = self

        class _Held:
            __slots__ = ("key", "size")

            def __init__(self, key: int, size: int) -> None:
                self.key, self.size = key, size

            def __del__(self) -> None:
                tracker._release(self.key, self.size)

        def pack(tensor: torch.Tensor):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in tracker._params or tensor.device.type == "meta":
                return tensor, None
            tracker._acquire(key, storage.nbytes())
            return tensor, _Held(key, storage.nbytes())

        def unpack(packed):
            return packed[0]

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _acquire(self, key: int, size: int) -> None:
        count = self._refs.get(key, 0)
        if count == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] = count + 1

    def _release(self, key: int, size: int) -> None:
        count = self._refs.get(key, 0) - 1
        if count <= 0:
            self._refs.pop(key, None)
            self.live -= size
        else:
            self._refs[key] = count

    def reset(self) -> None:
        self.peak = self.live


def _rank(
    rank: int, world_size: int, schedules: dict, microbatches: list, steps: int, model_kwargs: dict, batch: int
) -> dict:
    import torch.distributed as dist

    from examples.nlp.model import GPT
    from lightning_parallel.parallel.pipeline.partition import partition_layers
    from lightning_parallel.parallel.pipeline.runner import PipelineRunner
    from lightning_parallel.parallel.pipeline.schedules import stage_ids_for_rank
    from lightning_parallel.parallel.pipeline.stages import split_module
    from lightning_parallel.parallel.pipeline.timeline import StageTimeline

    dist.init_process_group("gloo")
    results = {}
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, model_kwargs["seq_len"]), generator=generator)
    y = torch.randint(0, 256, (batch, model_kwargs["seq_len"]), generator=generator)
    for schedule, spr in schedules.items():
        for m in microbatches:
            torch.manual_seed(0)
            model = GPT(**model_kwargs).build()
            layers = model.pipeline_layers()
            stage_ids = stage_ids_for_rank(schedule, rank, world_size, spr)
            bounds = partition_layers(layers, world_size * spr, "parameters")
            _, stages = split_module(model, layers, bounds, stage_ids)
            last = next(
                r for r in range(world_size) if world_size * spr - 1 in stage_ids_for_rank(schedule, r, world_size, spr)
            )
            runner = PipelineRunner(stages, stage_ids, world_size * spr, schedule, m, model.pipeline_loss,
                                    torch.device("cpu"), dist.group.WORLD, last)
            timeline = StageTimeline(runner.stages)
            saved = SavedActivations()
            saved.exclude(model)
            per_step, peaks = [], []
            for step in range(steps + 1):
                timeline.clear()
                saved.reset()
                dist.barrier()
                with saved.hooks():
                    runner.train_step(x, y)
                model.zero_grad(set_to_none=True)
                if step >= 1:
                    per_step.append([(e.stage, e.kind, e.microbatch, e.start, e.end) for e in timeline.events])
                    peaks.append(saved.peak - saved.live)
            timeline.detach()
            results[f"{schedule}/{m}"] = {"events": per_step, "peak_activation_bytes": max(peaks)}
    return results


def measure(stages: int = 2, microbatches: tuple = (4, 8), steps: int = 4, model_kwargs: dict | None = None,
            batch: int = 16, schedules: dict | None = None, timeout: float = 1200) -> tuple[list[dict], dict]:
    """Run every schedule at every micro-batch count.

    Args:
        stages: pipeline ranks (p).
        microbatches: micro-batch counts (m) to run.
        steps: measured steps per run (after 1 warm-up step).
        model_kwargs: GPT arguments.
        batch: samples per step (divisible by every m).
        schedules: ``{schedule: stages per rank}`` (default :data:`SCHEDULES`).
        timeout: seconds for the whole run.

    Returns:
        ``(rows, timelines)``: one row per (schedule, m) with measured and theoretical idle
        fractions and peak activation bytes per rank; ``timelines[schedule/m]`` is the
        median step's events per rank (for Gantt charts), times relative to its start.
    """
    from lightning_parallel.parallel.pipeline.schedules import available_schedules
    from lightning_parallel.parallel.pipeline.timeline import ComputeEvent, median_idle, theoretical_bubble
    from lightning_parallel.testing import run_processes

    model_kwargs = model_kwargs or {"seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4}
    chosen = {s: v for s, v in (schedules or SCHEDULES).items() if s in available_schedules()}
    per_rank = run_processes(_rank, stages, chosen, list(microbatches), steps, model_kwargs, batch, timeout=timeout)
    rows, timelines = [], {}
    for schedule, spr in chosen.items():
        for m in microbatches:
            key = f"{schedule}/{m}"
            steps_events = [
                [[ComputeEvent(*e) for e in per_rank[r][key]["events"][s]] for r in range(stages)] for s in range(steps)
            ]
            idle = median_idle(steps_events)
            spans = [max(e.end for rk in st for e in rk) - min(e.start for rk in st for e in rk) for st in steps_events]
            median_step = sorted(range(steps), key=lambda s: spans[s])[steps // 2]
            origin = min(e.start for rk in steps_events[median_step] for e in rk)
            timelines[key] = [[(e.stage, e.kind, e.microbatch, e.start - origin, e.end - origin) for e in rk]
                              for rk in steps_events[median_step]]
            mean_idle = sum(idle) / len(idle)
            rows.append({
                "schedule": schedule, "p": stages, "m": m, "v": spr,
                "idle_per_rank": [round(i, 3) for i in idle], "idle_mean": round(mean_idle, 3),
                "efficiency": round(1 - mean_idle, 3),
                "theory_v1": round(theoretical_bubble(stages, m, 1), 3),
                "theory": round(theoretical_bubble(stages, m, spr), 3),
                "step_ms": round(1e3 * statistics.median(spans), 1),
                "peak_activation_bytes": [per_rank[r][key]["peak_activation_bytes"] for r in range(stages)],
            })
    return rows, timelines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows, _ = measure(args.stages, tuple(args.microbatches), args.steps)
    print(f"{'schedule':26s} {'m':>3s} {'idle per rank':>16s} {'mean':>6s} {'theory':>7s} {'step ms':>8s} "
          f"{'peak act MiB':>14s}")
    for row in rows:
        peak = "/".join(f"{b / 2**20:.1f}" for b in row["peak_activation_bytes"])
        print(f"{row['schedule']:26s} {row['m']:3d} {row['idle_per_rank']!s:>16s} {row['idle_mean']:6.3f} "
              f"{row['theory']:7.3f} {row['step_ms']:8.1f} {peak:>14s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
