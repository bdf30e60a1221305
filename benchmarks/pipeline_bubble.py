"""Measured pipeline bubble (idle fraction per rank, from timestamps) against (p-1)/(v*m+p-1).

    python -m benchmarks.pipeline_bubble --stages 2 --microbatches 8 --steps 6

Each schedule runs the same residual MLP split into stages by the library's own
machinery (``split_module`` + ``PipelineRunner``); a :class:`StageTimeline` records every
forward/backward on every rank. The idle fraction of a rank is the share of the step
window (first start to last end over all ranks) in which it computed nothing: bubbles plus
send/recv and Python overhead. Medians over steps after two warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zero_bubble": 2, "zbv": 2}


def _rank(rank: int, world_size: int, schedules: dict, microbatches: int, steps: int, width: int, batch: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_parallel.parallel.partition import partition_layers
    from lightning_parallel.parallel.pipeline import PipelineRunner, split_module, stage_ids_for_rank
    from lightning_parallel.parallel.timeline import StageTimeline
    from lightning_parallel.testing.models import ResidualMLP

    dist.init_process_group("gloo")
    results = {}
    for schedule, spr in schedules.items():
        torch.manual_seed(0)
        model = ResidualMLP(width=width, depth=4 * world_size * spr - 2, hidden=4 * width)
        layers = model.pipeline_layers()
        stage_ids = stage_ids_for_rank(schedule, rank, world_size, spr)
        bounds = partition_layers(layers, world_size * spr, "uniform")
        _, stages = split_module(model, layers, bounds, stage_ids)
        last = next(r for r in range(world_size) if world_size * spr - 1 in stage_ids_for_rank(schedule, r, world_size, spr))
        runner = PipelineRunner(stages, stage_ids, world_size * spr, schedule, microbatches, F.mse_loss, torch.device("cpu"), dist.group.WORLD, last)
        timeline = StageTimeline(runner.stages)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        per_step = []
        for step in range(steps + 2):
            timeline.clear()
            dist.barrier()
            runner.train_step(x, y)
            model.zero_grad(set_to_none=True)
            if step >= 2:
                per_step.append([(e.stage, e.kind, e.microbatch, e.start, e.end) for e in timeline.events])
        timeline.detach()
        results[schedule] = per_step
    dist.destroy_process_group()
    return results


def measure(stages: int = 2, microbatches: int = 8, steps: int = 6, width: int = 512, batch: int = 512) -> list[dict]:
    """Run every schedule and return one row per schedule with measured and theoretical idle fractions.

    Args:
        stages: pipeline ranks (p).
        microbatches: micro-batches per step (m).
        steps: measured steps per schedule (after 2 warm-up steps).
        width: model width (bigger: compute dominates communication).
        batch: samples per step.
    """
    from lightning_parallel.parallel.pipeline import available_schedules
    from lightning_parallel.parallel.timeline import ComputeEvent, median_idle, theoretical_bubble
    from lightning_parallel.testing import run_processes

    schedules = {s: v for s, v in SCHEDULES.items() if s in available_schedules()}
    per_rank = run_processes(_rank, stages, schedules, microbatches, steps, width, batch, timeout=1200)
    rows = []
    for schedule, spr in schedules.items():
        steps_events = [[[ComputeEvent(*e) for e in per_rank[r][schedule][s]] for r in range(stages)] for s in range(steps)]
        idle = median_idle(steps_events)
        step_ms = statistics.median(
            1e3 * (max(e.end for rank in step for e in rank) - min(e.start for rank in step for e in rank)) for step in steps_events
        )
        theory = theoretical_bubble(stages, microbatches, spr)
        rows.append({"schedule": schedule, "p": stages, "m": microbatches, "v": spr, "idle_per_rank": [round(i, 3) for i in idle],
                     "idle_mean": round(sum(idle) / len(idle), 3), "theory": round(theory, 3), "step_ms": round(step_ms, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = measure(args.stages, args.microbatches, args.steps, args.width)
    print(f"{'schedule':26s} {'idle per rank':>18s} {'mean':>6s} {'theory':>7s} {'step ms':>8s}")
    for row in rows:
        print(f"{row['schedule']:26s} {str(row['idle_per_rank']):>18s} {row['idle_mean']:6.3f} {row['theory']:7.3f} {row['step_ms']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
