"""Turn the runner's measurements into results.json, results.csv, report.md and PNG plots.

Every table of ``report.md`` says how its numbers were measured, next to them; the
targets (strategy overhead at most max(0.5 ms, 2%) over the raw loop) are checked here.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

OVERHEAD_FLOOR_MS, OVERHEAD_FRACTION = 0.5, 0.02
MiB = 2**20



def _max_loss_diff(ranks: list[dict]) -> float:
    """Largest |Trainer loss - raw loss| over ranks and steps, the raw loss averaged over ranks per step.

    The recipe's training loss is the global batch's token mean on every rank (``global_token_mean``:
    the value is global, the gradient local), while a raw loop reports its own rank's mean. Windows
    have a fixed length, so every rank holds the same number of tokens and the global mean is the mean
    of the ranks' means (ranks that repeat a data shard, tensor or pipeline peers, count equally).
    """
    raw_means = [sum(step) / len(step) for step in zip(*(r["raw_losses"] for r in ranks))]
    return max(abs(a - b) for r in ranks for a, b in zip(r["trainer_losses"], raw_means))

def summarize_layouts(raw: dict[str, list[dict]], specs: dict, seq_len: int) -> dict[str, dict]:
    """One record per layout from the per-rank results (times: mean over ranks of each rank's median)."""
    out: dict[str, dict] = {}
    for name, ranks in raw.items():
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            out[name] = {"error": errors[0], "world": specs[name]["world"]}
            continue
        mean = lambda key: statistics.fmean(r[key] for r in ranks)
        trainer_ms, raw_ms, paired = mean("trainer_ms"), mean("raw_ms"), mean("paired_overhead_ms")
        target = max(OVERHEAD_FLOOR_MS, OVERHEAD_FRACTION * raw_ms)
        out[name] = {
            "world": specs[name]["world"], "strategy": specs[name].get("strategy", specs[name].get("anchor")),
            "raw_loop": specs[name]["raw"], "anchor_of": specs[name].get("anchor_of"),
            "trainer_ms": round(trainer_ms, 2), "raw_ms": round(raw_ms, 2),
            "overhead_ms": round(paired, 2), "ratio": round(trainer_ms / raw_ms, 3),
            "target_ms": round(target, 2), "target_met": paired <= target,
            "tokens_per_s": round(ranks[0]["global_batch"] * seq_len / (trainer_ms / 1e3)),
            "raw_tokens_per_s": round(ranks[0]["global_batch"] * seq_len / (raw_ms / 1e3)),
            "startup_s": round(max(r["startup_s"] for r in ranks), 3),
            "raw_startup_s": round(max(r["raw_startup_s"] for r in ranks), 3),
            "val_loss": round(ranks[0]["val_loss"], 5), "raw_val_loss": round(ranks[0]["raw_val_loss"], 5),
            "max_loss_diff_vs_raw": _max_loss_diff(ranks),
            "samples": ranks[0]["samples"], "steps_timed": ranks[0]["steps_timed"],
            "memory_per_rank": [r["memory"] for r in ranks], "raw_memory_per_rank": [r["raw_memory"] for r in ranks],
            "comm_rank0": ranks[0]["comm"], "raw_comm_rank0": ranks[0]["raw_comm"],
        }
        if "ddp_buckets_bytes" in ranks[0]:
            out[name]["ddp_buckets_bytes"] = ranks[0]["ddp_buckets_bytes"]
            out[name]["raw_ddp_buckets_bytes"] = ranks[0]["raw_ddp_buckets_bytes"]
    single = out.get("single", {}).get("tokens_per_s")
    for record in out.values():
        if single and "tokens_per_s" in record:
            record["throughput_vs_single"] = round(record["tokens_per_s"] / single, 3)
    return out


def deepspeed_formulas(layouts: dict, params: int) -> list[dict]:
    """Measured DeepSpeed bytes per rank beside ZeRO's formulas (fp32 here; mixed precision in the text)."""
    rows = []
    for stage in (1, 2, 3):
        record = layouts.get(f"deepspeed_zero{stage}")
        if not record or "error" in record:
            continue
        n = record["world"]
        mem = record["memory_per_rank"][0]
        # fp32 on CPU: 4-byte parameters and gradients, 8 bytes of AdamW moments, and the
        # 4-byte fp32 partition ZeRO steps (DeepSpeed keeps it even when training in fp32).
        expect = {
            "params": 4 * params / (n if stage == 3 else 1),
            "grads": 4 * params / (1 if stage == 1 else n),
            "optim": 8 * params / n,
            "master": 4 * params / n,
        }
        mixed = {1: "4 + 12/N", 2: "2 + 14/N", 3: "16/N"}[stage]
        fp32 = {1: "8 + 12/N", 2: "4 + 16/N", 3: "20/N"}[stage]
        total = sum(mem.get(k, 0) for k in expect)
        rows.append({
            "stage": stage, "N": n, "measured": mem, "formula_bytes": {k: round(v) for k, v in expect.items()},
            "bytes_per_param": round(total / params, 3), "formula_fp32": fp32,
            "formula_fp32_value": round(sum(expect.values()) / params, 3), "formula_mixed_precision": mixed,
        })
    return rows


def expected_communication(model: dict, batch: int, microbatches: int) -> dict[str, dict]:
    """Communication per step each layout should show, from the model shape (fp32 payloads, rank 0)."""
    layers, d, seq = model["n_layer"], model["d_model"], model["seq_len"]
    act = batch * seq * d * 4
    mb_act = act // microbatches
    return {
        "pipeline_1f1b": {"isend": {"count": microbatches, "bytes": microbatches * mb_act},
                          "irecv": {"count": microbatches, "bytes": microbatches * mb_act},
                          "broadcast": {"count": 1, "bytes": 4},
                          "why": "rank 0 sends m activations and receives m gradients of (b/m, seq, d) fp32; "
                                 "one broadcast gives every rank the loss"},
        "tensor_parallel": {"dtensor.all_reduce": {"count": 4 * layers + 2, "bytes": (4 * layers + 2) * act},
                            "dtensor.all_gather_into_tensor": {"count": 1, "bytes": batch * seq * 256 * 4 // 2},
                            "why": "forward: 1 all-reduce per row-parallel layer (attn.out, mlp.down) and the "
                                   "embedding = 2L+1; backward: 1 per gather_input (attn, mlp) and the LM head's "
                                   "input = 2L+1; the LM head gathers its vocab-sharded logits once"},
        "ddp": {"all_reduce (DDP buckets)": {"count": 1, "bytes": "all parameters"},
                "why": "one 25 MiB bucket holds every gradient"},
    }


def write_all(out: Path, results: dict, plots: bool) -> list[Path]:
    """Write results.json, results.csv, report.md and (optionally) the PNG plots into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    _write_csv(out / "results.csv", results.get("layouts", {}))
    images = _plots_if_available(out, results) if plots else []
    (out / "report.md").write_text(render_markdown(results, [p.name for p in images]))
    return [out / "results.json", out / "results.csv", out / "report.md", *images]


CSV_COLUMNS = ("layout", "world", "strategy", "raw_loop", "trainer_ms", "raw_ms", "overhead_ms", "ratio", "target_ms",
               "target_met", "tokens_per_s", "throughput_vs_single", "startup_s", "raw_startup_s", "val_loss",
               "raw_val_loss", "max_loss_diff_vs_raw", "samples", "error")


def _write_csv(path: Path, layouts: dict) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for name, record in layouts.items():
            writer.writerow({"layout": name, **record})


def _mib(value: float) -> str:
    return f"{value / MiB:.3f}"


def render_markdown(results: dict, images: list[str]) -> str:
    """The report: one section per metric, each with how it was measured."""
    meta, layouts = results["meta"], results.get("layouts", {})
    lines = [f"# lightning_parallel benchmarks — {meta['date']}", "",
             f"`{meta['command']}` · {meta['machine']} · torch {meta['torch']}, lightning {meta['lightning']}, "
             f"deepspeed {meta['deepspeed']} · commit {meta['commit']} · wall time {meta['runtime_s']:.0f} s"
             + (" · **quick mode**" if meta["quick"] else ""), "",
             f"Model: GPT recipe (`examples/nlp`) {meta['model']}, global batch {meta['batch_size']}, fp32, AdamW; "
             f"{meta['steps']} timed steps per layout after {meta['warmup']} warm-up steps.", ""]
    trainer_rows = {k: v for k, v in layouts.items() if not k.startswith("anchor_")}
    anchors = {k: v for k, v in layouts.items() if k.startswith("anchor_")}
    lines += ["## 1. Strategy overhead vs the raw loop it wraps", "",
              "How: in one process group, every Trainer step is followed by one step of a hand-written loop "
              "(same model init, data order, AdamW param groups and LR schedule, same mesh/schedule, and on "
              "data-parallel layouts the recipe's global token-mean loss with its one all-reduce per step) — "
              "A B A B. "
              "Trainer step = time between consecutive `on_train_batch_start` minus the raw step run in between; "
              "raw step includes its `next(loader)`. Medians over timed steps, mean over ranks; overhead = median "
              "of the paired differences. Target: overhead ≤ max(0.5 ms, 2% of raw). The Trainer runs as `lp-train` "
              "runs it, with `GracefulStop` (a stop agreement every ~1 s instead of Lightning's per-step SIGTERM "
              "broadcast).", "",
              "| layout | raw loop | Trainer ms | raw ms | overhead ms | ratio | target ms | met | loss diff vs raw |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, r in trainer_rows.items():
        if "error" in r:
            lines.append(f"| {name} | — | error: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(f"| {name} | {r['raw_loop']} | {r['trainer_ms']:.2f} | {r['raw_ms']:.2f} | "
                     f"{r['overhead_ms']:+.2f} | {r['ratio']:.3f} | {r['target_ms']:.2f} | "
                     f"{'yes' if r['target_met'] else '**no**'} | {r['max_loss_diff_vs_raw']:.1e} |")
    lines += ["", "## 2. Anchors on the same work", "",
              "How: the anchor runs against the *same* raw loop, alternating step by step as in 1, so ours and the "
              "anchor are compared through their ratios to one raw loop.", "",
              "| anchor | compared with | anchor ms | raw ms | anchor / raw | ours / raw | val loss anchor / ours |",
              "|---|---|---|---|---|---|---|"]
    for name, r in anchors.items():
        ours = layouts.get(r.get("anchor_of") or "", {})
        if "error" in r:
            lines.append(f"| {name} | {r.get('anchor_of')} | error: {r['error'][:160]} | | | | |")
            continue
        lines.append(f"| {name} | {r['anchor_of']} | {r['trainer_ms']:.2f} | {r['raw_ms']:.2f} | {r['ratio']:.3f} | "
                     f"{ours.get('ratio', float('nan')):.3f} | "
                     f"{r['val_loss']:.4f} / {ours.get('val_loss', float('nan')):.4f} |")
    lines += ["", "Lightning's own `DeepSpeedStrategy` refuses a CPU accelerator (it checks for CUDA), "
              "so on this machine `deepspeed_zero*` is compared with raw `deepspeed.initialize` only (section 1); "
              "the GPU mode "
              "(`benchmarks/gpu.sh`) is where Lightning's would run.", ""]
    pipe = results.get("pipeline", [])
    if pipe:
        lines += ["## 3. Pipeline: bubble, efficiency, activation memory (p=2)", "",
                  "How: raw `PipelineRunner` on the GPT layers (partition by parameters); `StageTimeline` stamps every "
                  "F/B/W action; idle = share of the step window (first start to last end, all ranks) a rank computed "
                  "nothing, median over steps; efficiency = 1 − mean idle. Theory: (p−1)/(m+p−1) for v=1 and "
                  "(p−1)/(v·m+p−1) for v stages per rank. Peak activations: max live bytes of tensors autograd saved "
                  "for backward (`saved_tensors_hooks`, counted once per storage, parameters excluded), per rank.", "",
                  "| schedule | v | m | idle per rank | mean idle | efficiency | theory (p−1)/(m+p−1) "
                  "| theory (p−1)/(vm+p−1) | step ms | peak activations MiB / rank |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in pipe:
            lines.append(f"| {r['schedule']} | {r['v']} | {r['m']} | {r['idle_per_rank']} | {r['idle_mean']:.3f} | "
                         f"{r['efficiency']:.3f} | {r['theory_v1']:.3f} | {r['theory']:.3f} | {r['step_ms']:.1f} | "
                         f"{' / '.join(_mib(b) for b in r['peak_activation_bytes'])} |")
        lines.append("")
    mem = results.get("memory", [])
    if mem:
        lines += ["## 4. Memory per rank", "",
                  "How: `HybridParallelStrategy` fits 2 steps; just before the second optimizer step each rank sums "
                  "the local bytes of its parameters, their gradients and AdamW's state (DTensors: local shard). "
                  "Formula, computed on the rank from metadata: each parameter's global bytes / the product of the "
                  "mesh sizes it is sharded over (TP 1/t on planned matrices, FSDP2 1/d); a pure pipeline rank holds "
                  "its stages' `parameters_per_stage` (≈1/p); gradients = parameters; AdamW state = 2 × parameters. "
                  "`exact` = measured equals formula byte for byte (params / grads / optimizer).", "",
                  "| layout | world | params MiB / rank | vs single | formula MiB | grads MiB | optimizer MiB "
                  "| exact p/g/o |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mem:
            exact = "/".join("yes" if r[k] else "**no**" for k in ("params_exact", "grads_exact", "optim_exact"))
            lines.append(f"| {r['layout']} | {r['world']} | {' / '.join(_mib(b) for b in r['params'])} | "
                         f"{r['params_ratio']} | {' / '.join(_mib(b) for b in r['expected_params'])} | "
                         f"{' / '.join(_mib(b) for b in r['grads'])} | {' / '.join(_mib(b) for b in r['optim'])} | "
                         f"{exact} |")
        lines.append("")
    ds = results.get("deepspeed_memory", [])
    if ds:
        lines += ["DeepSpeed ZeRO (rank 0; read from the engine's ZeRO optimizer before `engine.step`: parameters — "
                  "ZeRO-3 its partition —, gradient partitions, the fp32 partition it steps, AdamW state). fp32 on "
                  "CPU: formula bytes/param beside the mixed-precision ones of the ZeRO paper.", "",
                  "| stage | N | params MiB | grads MiB | fp32 partition MiB | optimizer MiB | bytes/param measured "
                  "| fp32 formula | mixed-precision formula |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in ds:
            m = r["measured"]
            lines.append(f"| ZeRO-{r['stage']} | {r['N']} | {_mib(m['params'])} | {_mib(m['grads'])} | "
                         f"{_mib(m.get('master', 0))} | {_mib(m['optim'])} | {r['bytes_per_param']} | "
                         f"{r['formula_fp32']} = {r['formula_fp32_value']} | {r['formula_mixed_precision']} |")
        lines.append("")
    lines += ["## 5. Communication per step (rank 0)", "",
              "How: one extra step on each side runs inside `CommCounter` (`benchmarks/comm.py`): `torch.distributed` "
              "functions wrapped in this process (p2p: `isend`/`irecv`, reached through `batch_isend_irecv`), DTensor "
              "functional collectives through a dispatch mode (as `CommDebugMode`); DDP's C++ all-reduces are its "
              "bucket count. Bytes = payload on the rank.", "",
              "| layout | ours: op × count (MiB) | raw loop: op × count (MiB) | expected |", "|---|---|---|---|"]
    expected = results.get("expected_comm", {})
    for name, r in layouts.items():
        if "error" in r:
            continue
        fmt = lambda c: ", ".join(f"{op} ×{v['count']:g} ({v['bytes'] / MiB:.2f})" for op, v in c.items()) or "—"
        ours, raw = fmt(r["comm_rank0"]), fmt(r["raw_comm_rank0"])
        if "ddp_buckets_bytes" in r:
            ours += f"; DDP buckets ×{len(r['ddp_buckets_bytes'])} ({sum(r['ddp_buckets_bytes']) / MiB:.2f})"
            raw += f"; DDP buckets ×{len(r['raw_ddp_buckets_bytes'])} ({sum(r['raw_ddp_buckets_bytes']) / MiB:.2f})"
        exp = expected.get(name)
        exp_text = ""
        if exp:
            exp_text = ", ".join(f"{op} ×{v['count']}" for op, v in exp.items() if op != "why") + f" — {exp['why']}"
        lines.append(f"| {name} | {ours} | {raw} | {exp_text} |")
    for r in mem:
        if r.get("comm"):
            lines.append(f"| hybrid {r['layout']} (world {r['world']}) | "
                         + ", ".join(f"{op} ×{v['count']:g} ({v['bytes'] / MiB:.2f})" for op, v in r["comm"].items())
                         + " | | |")
    lines += ["", "## 6. Scaling and accuracy", "",
              "How: throughput = global batch × seq_len / Trainer step time; ratio to the single-device Trainer run. "
              "Validation loss of the recipe after the same samples (same data order in every layout).", "",
              "| layout | world | tokens/s | vs single | samples | val loss | raw loop val loss |",
              "|---|---|---|---|---|---|---|"]
    for name, r in layouts.items():
        if "error" not in r:
            lines.append(f"| {name} | {r['world']} | {r['tokens_per_s']} | {r.get('throughput_vs_single', '')} | "
                         f"{r['samples']} | {r['val_loss']:.4f} | {r['raw_val_loss']:.4f} |")
    lines += ["", "Two ranks share two cores here (each rank runs one thread), so ratios above 1 are not expected "
              "on this machine.", "", "## 7. Start-up cost", "",
              "How: seconds from `trainer.fit(...)` to the first `on_train_batch_start` (the raw loop's own build, "
              "run from `on_train_start`, subtracted); raw: parallelising plus optimizer construction.", "",
              "| layout | Trainer + strategy s | raw s |", "|---|---|---|"]
    for name, r in layouts.items():
        if "error" not in r:
            lines.append(f"| {name} | {r['startup_s']:.3f} | {r['raw_startup_s']:.3f} |")
    if results.get("activation_memory"):
        from benchmarks.activation_memory import HOW, render_rows

        lines += ["", "## 8. Activation checkpointing: peak activation memory and step time per rank", "", HOW, "",
                  render_rows(results["activation_memory"])]
    gpu = results.get("gpu") or {}
    lines += ["", "## GPU mode (MFU)", "", gpu.get("note", "not run") if not gpu.get("rows") else "", ""]
    for r in gpu.get("rows", []):
        lines.append(f"- {r}")
    if images:
        lines += ["", "## Plots", ""] + [f"![{img}]({img})" for img in images]
    return "\n".join(lines) + "\n"


def _plots_if_available(out: Path, results: dict) -> list[Path]:
    """The PNG plots, or none with one line naming the extra to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[benchmarks] plots skipped: matplotlib is not installed (pip install -e '.[bench]'); "
              "every other result file is written.", flush=True)
        return []
    return _plots(out, results)


def _plots(out: Path, results: dict) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    layouts = {k: v for k, v in results.get("layouts", {}).items() if "error" not in v}
    if layouts:
        names = list(layouts)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
        x = range(len(names))
        a1.bar([i - 0.2 for i in x], [layouts[n]["trainer_ms"] for n in names], 0.4, label="Trainer + strategy")
        a1.bar([i + 0.2 for i in x], [layouts[n]["raw_ms"] for n in names], 0.4, label="raw loop")
        a1.set_ylabel("ms / step (median)")
        a2.bar(list(x), [layouts[n]["tokens_per_s"] / 1e3 for n in names])
        a2.set_ylabel("k tokens / s")
        for ax in (a1, a2):
            ax.set_xticks(list(x), names, rotation=35, ha="right", fontsize=7)
        a1.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "step_time.png")
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    mem = results.get("memory", [])
    if mem:
        fig, ax = plt.subplots(figsize=(11, 3.6))
        labels = []
        for r in mem:
            for rank in range(r["world"]):
                labels.append(f"{r['layout']} r{rank}")
        series = {k: [b / MiB for r in mem for b in r[k]] for k in ("params", "grads", "optim")}
        bottom = [0.0] * len(labels)
        for key, values in series.items():
            ax.bar(range(len(labels)), values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=6)
        ax.set_ylabel("MiB per rank")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "memory_per_rank.png")
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    timelines = results.get("pipeline_timelines", {})
    if timelines:
        keys = [k for k in timelines if k.endswith(f"/{max(int(k.split('/')[1]) for k in timelines)}")]
        fig, axes = plt.subplots(len(keys), 1, figsize=(10, 1.3 * len(keys) + 0.6), squeeze=False)
        colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
        for ax, key in zip(axes[:, 0], keys):
            for rank, events in enumerate(timelines[key]):
                for stage, kind, mb, start, end in events:
                    ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color=colors[kind], edgecolor="white",
                            linewidth=0.3)
            ax.set_yticks(range(len(timelines[key])), [f"rank {r}" for r in range(len(timelines[key]))], fontsize=7)
            ax.invert_yaxis()
            ax.set_title(key.replace("/", ", m="), fontsize=8, loc="left")
            ax.tick_params(axis="x", labelsize=7)
        axes[-1, 0].set_xlabel("ms from step start (F forward, B backward / input-grad, W weight-grad)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        axes[0, 0].legend(handles, list(colors), fontsize=7, ncol=3, loc="upper right")
        fig.tight_layout()
        paths.append(out / "pipeline_timeline.png")
        fig.savefig(paths[-1], dpi=80)
        plt.close(fig)
    if results.get("activation_memory"):
        from benchmarks.activation_memory import plot

        paths.append(plot(results["activation_memory"], out / "activation_memory.png"))
    return paths
