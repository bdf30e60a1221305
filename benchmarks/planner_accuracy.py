"""How well the layout planner predicts this machine: ranking, pick, and bytes per rank against real runs.

    python -m benchmarks.planner_accuracy [--steps 8] [--json out.json]

For each case (the GPT recipe's model on 2 and 4 processes, and a widened GPT on 4 processes
under ``conf/cluster/cpu_capped.yaml``, whose memory cap rules out pure data parallelism) the
planner ranks every valid candidate of its search space; then every candidate that fits is
trained for a few steps under :class:`~lightning_parallel.strategies.HybridParallelStrategy`
(one group of processes per case, layouts one after another, as ``benchmarks.memory_per_rank``
does) and measured:

* throughput: the global batch over the median wall time between successive batch starts
  (after 3 warm-up batches; the optimizer step included), the better of two passes over the
  layouts, the second in reverse order (the load of the shared machine drifts);
* parameter + gradient + optimizer bytes of each rank just before the second optimizer step,
  against the planner's formula for the most loaded rank (the maximum over ranks);
* peak bytes autograd saves for backward during a step (``benchmarks.pipeline_bubble.SavedActivations``),
  for layouts without tensor parallelism and ZeRO-2/3, against the planner's activations plus the
  unsharded weights FSDP2 keeps (``zero_stage=0`` with ``dp > 1`` runs on FSDP2 with shard groups of one).

Reported: Spearman's rank correlation of predicted and measured throughput, the measured
throughput of the planner's pick against the best measured one, exact-bytes agreement and the
activation error. The search space is kept small for 2 shared cores: hybrid strategy only
(DeepSpeed runs in its own launcher), schedules 1F1B and interleaved 1F1B, one batch per
optimizer step, no activation checkpointing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

CASES = {
    "gpt world 2": ({"seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4}, 2, "cpu"),
    "gpt world 4": ({"seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4}, 4, "cpu"),
    "wide gpt world 4, capped": ({"seq_len": 64, "d_model": 256, "n_layer": 4, "n_head": 4}, 4, "cpu_capped"),
}
GLOBAL_BATCH = 16


def _probe(track_saved: bool):
    import lightning.pytorch as pl

    from benchmarks.pipeline_bubble import SavedActivations
    from benchmarks.raw_loops import module_bytes

    class Probe(pl.Callback):
        """Batch start times, bytes before the second optimizer step, saved activations of step 2."""

        def __init__(self) -> None:
            self.starts, self.memory, self.saved, self._hooks = [], {}, None, None

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            import time

            self.starts.append(time.perf_counter())
            if batch_idx == 2 and track_saved:
                self.saved = SavedActivations()
                for p in module.parameters():
                    try:
                        self.saved._params.add(p.untyped_storage().data_ptr())
                    except RuntimeError:  # a pipeline rank's parameters of other stages hold no storage
                        pass
                self._hooks = self.saved.hooks()
                self._hooks.__enter__()

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            if trainer.global_step == 1:
                self.memory = module_bytes(module, getattr(optimizer, "_optimizer", optimizer))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
                self._hooks = None

    return Probe()


def _rank(rank: int, world: int, layouts: dict, model_kwargs: dict, steps: int) -> dict:
    import time
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import Subset

    from examples.nlp.data import ByteWindows, load_corpus
    from examples.nlp.model import GPT
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.models import FixedOrderData

    warnings.filterwarnings("ignore")
    train, _ = load_corpus(None, max_bytes=100_000, val_every=10)
    samples = Subset(ByteWindows(train, model_kwargs["seq_len"]), range((steps + 1) * GLOBAL_BATCH))
    out = {}
    # Two passes, the second in reverse order, keeping each layout's faster one: the load of a shared machine
    # drifts over minutes, and alternating the order keeps that drift from ranking the layouts.
    order = [*layouts, *reversed(layouts)]
    for name in order:
        kwargs = layouts[name]
        pl.seed_everything(0, verbose=False)
        probe = _probe(track_saved=kwargs["tensor_parallel_size"] == 1 and kwargs["zero_stage"] == 0)
        strategy = HybridParallelStrategy(**kwargs)
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             use_distributed_sampler=False, callbacks=[probe], limit_val_batches=0)
        model = GPT(**model_kwargs, optimizer=partial(torch.optim.AdamW, lr=1e-3))
        try:
            data = FixedOrderData(samples, batch_size=GLOBAL_BATCH // kwargs["data_parallel_size"])
            trainer.fit(model, datamodule=data)
        except Exception as error:  # noqa: BLE001 - a layout the strategy fails on is reported, the others still run
            out.setdefault(name, {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"})
            continue
        starts = probe.starts + [time.perf_counter()]
        steps_s = [b - a for a, b in zip(starts[3:], starts[4:])]
        step = statistics.median(steps_s)
        if name in out and "step" in out[name] and out[name]["step"] <= step:
            continue
        out[name] = {**probe.memory, "step": step, "saved": probe.saved.peak if probe.saved else None}
    return out


def _strategy_kwargs(c) -> dict:
    return {"data_parallel_size": c.dp, "pipeline_parallel_size": c.pp, "tensor_parallel_size": c.tp,
            "zero_stage": c.zero, "schedule": c.schedule if c.pp > 1 else "1f1b",
            "stages_per_rank": c.stages_per_rank, "microbatches": c.microbatches if c.pp > 1 else 4}


def plan_case(model_kwargs: dict, world: int, cluster_name: str):
    """The planner's plan of one case (the model measured here, one micro-batch per layer)."""
    import torch

    from examples.nlp.model import GPT
    from lightning_parallel.planner.candidates import SearchSpace, Workload
    from lightning_parallel.planner.cluster import load_cluster
    from lightning_parallel.planner.plan import make_plan
    from lightning_parallel.planner.profile import profile_module
    from lightning_parallel.runtime.config_dir import CONFIG_DIR
    from lightning_parallel.scaling import Reference

    torch.manual_seed(0)
    torch.set_num_threads(1)  # as each rank runs (2 processes on 2 cores)
    model = GPT(**model_kwargs).build()
    shape = profile_module(model, torch.randint(0, 256, (GLOBAL_BATCH, model_kwargs["seq_len"])), "gpt")
    work = Workload("fixed_global_batch", Reference(GLOBAL_BATCH, 1e-3), GLOBAL_BATCH // world)
    space = SearchSpace(deepspeed_stages=(), schedules=("1f1b", "interleaved_1f1b"), microbatch_factors=(1, 2),
                        max_accumulation=1)
    return make_plan(shape, load_cluster(cluster_name, CONFIG_DIR), world, work, space)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def _predicted_states(plan, c) -> int:
    from lightning_parallel.planner.memory import stage_layers, state_bytes

    return max(sum(state_bytes(plan.shape, c, [i for s in rank for i in s])) for rank in stage_layers(plan.shape, c))


def run_case(name: str, steps: int, timeout: float) -> dict:
    """Plan one case, measure every candidate that fits, and compare."""
    from lightning_parallel.testing import run_processes

    model_kwargs, world, cluster = CASES[name]
    plan = plan_case(model_kwargs, world, cluster)
    layouts = {p.candidate.name: _strategy_kwargs(p.candidate) for p in plan.ranked}
    per_rank = run_processes(_rank, world, layouts, model_kwargs, steps, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    rows, failed = [], {}
    for p in plan.ranked:
        c, ranks = p.candidate, [r[p.candidate.name] for r in per_rank]
        if any("error" in r for r in ranks):
            failed[c.name] = next(r["error"] for r in ranks if "error" in r)
            continue
        measured_states = max(r["params"] + r["grads"] + r["optim"] for r in ranks)
        saved = [r["saved"] for r in ranks] if c.tp == 1 and c.zero == 0 else None
        rows.append({
            "layout": c.name, "predicted": p.throughput,
            "measured": c.global_batch / statistics.median(r["step"] for r in ranks),
            "predicted_states": _predicted_states(plan, c), "measured_states": measured_states,
            # What autograd holds: activations, and under FSDP2 (zero_stage 0 runs on it too) the unsharded
            # weights it saves, which are not the registered parameters' storages.
            "predicted_activations": p.memory.activations + p.memory.working,
            "measured_activations": max(saved) if saved else None,
        })
    return {**_summary(name, plan, rows), "failed": failed}


def _summary(name: str, plan, rows: list[dict]) -> dict:
    best = max(rows, key=lambda r: r["measured"])
    pick = rows[0]  # ranked order: the planner's pick first
    act = [r for r in rows if r["measured_activations"]]
    return {
        "case": name, "rows": rows, "rejected": [(r.label, r.reason) for r in plan.rejected],
        "spearman": spearman([r["predicted"] for r in rows], [r["measured"] for r in rows]),
        "pick": pick["layout"], "best_measured": best["layout"], "pick_gap": 1 - pick["measured"] / best["measured"],
        "states_exact": all(r["predicted_states"] == r["measured_states"] for r in rows),
        "activation_error_max": max(
            (abs(r["predicted_activations"] / r["measured_activations"] - 1) for r in act), default=None
        ),
    }


def print_case(result: dict) -> None:
    print(f"\n== {result['case']}: Spearman {result['spearman']:.3f}, pick {result['pick']} "
          f"(gap to best measured {result['best_measured']}: {result['pick_gap']:.1%}), "
          f"states exact {result['states_exact']}, activation error max {result['activation_error_max']}")
    print(f"{'layout':32s} {'pred/s':>8s} {'meas/s':>8s} {'pred states':>12s} {'meas states':>12s} "
          f"{'pred act':>10s} {'meas act':>10s}")
    for r in result["rows"]:
        act = f"{r['measured_activations']:10d}" if r["measured_activations"] else f"{'-':>10s}"
        print(f"{r['layout']:32s} {r['predicted']:8.1f} {r['measured']:8.1f} {r['predicted_states']:12d} "
              f"{r['measured_states']:12d} {r['predicted_activations']:10.0f} {act}")
    for layout, error in result.get("failed", {}).items():
        print(f"{layout:32s} failed to train: {error}")
    reasons = sorted({reason.split(':')[0] for _, reason in result["rejected"]})
    print(f"refused: {len(result['rejected'])} ({'; '.join(reasons)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--timeout", type=float, default=3000)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = []
    for name in args.cases:
        results.append(run_case(name, args.steps, args.timeout))
        print_case(results[-1])
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
