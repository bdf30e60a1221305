"""The benchmark runner: one command, every figure of the performance report.

    python -m benchmarks.run --quick          # < 5 minutes on 2 CPU cores (same as quick=true)
    python -m benchmarks.run                  # the full matrix (more timed steps)
    python -m benchmarks.run gpu=true         # also MFU on one CUDA device (benchmarks/gpu.py)
    python -m benchmarks.run sections=[layouts] layouts='{single: ...}' plots=false out_dir=/tmp/b

Configured with Hydra from ``benchmarks/conf/config.yaml``. Writes
``<out_dir>/<date>/results.json``, ``results.csv``, ``report.md`` and PNG plots. Sections:

* ``layouts`` -- :mod:`benchmarks.layouts`: Trainer + strategy vs the raw loop it wraps,
  A/B per step (overhead, anchors, communication, scaling, accuracy, start-up, memory);
* ``pipeline`` -- :mod:`benchmarks.pipeline_bubble`: bubble, efficiency, Gantt timelines,
  peak activation memory per schedule;
* ``memory`` -- :mod:`benchmarks.memory_per_rank`: bytes per rank for tp/pp/hybrid/FSDP
  layouts against the formulas;
* ``activation`` -- :mod:`benchmarks.activation_memory`: peak activation memory and step time
  with activation checkpointing none / selective / full (not in the default sections: ~5 minutes).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf


def _quick_flag(argv: list[str]) -> list[str]:
    """Hydra apps take ``key=value`` overrides, not flags: ``--quick`` becomes ``quick=true``."""
    return [("quick=true" if arg == "--quick" else arg) for arg in argv]


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              check=False)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def settings(cfg: DictConfig) -> dict[str, Any]:
    """The plain settings of this run: the config with ``quick_overrides`` merged in when ``quick``."""
    merged = OmegaConf.merge(cfg, cfg.quick_overrides) if cfg.quick else cfg
    return OmegaConf.to_container(merged, resolve=True)


def run(cfg: dict[str, Any]) -> tuple[dict, Path]:
    """Run the chosen sections and write every output file. Returns ``(results, output folder)``."""
    import lightning
    import torch

    start = time.perf_counter()
    sections = cfg["sections"]
    results: dict[str, Any] = {}
    common = {"model": cfg["model"], "data": cfg["data"], "batch_size": cfg["batch_size"],
              "warmup": cfg["warmup"], "steps": cfg["steps"]}
    if "layouts" in sections:
        from benchmarks.layouts import run_layouts
        from benchmarks.report import deepspeed_formulas, expected_communication, summarize_layouts

        specs = {name: dict(spec) for name, spec in cfg["layouts"].items()}
        raw = run_layouts([{"name": n, **s} for n, s in specs.items()], common)
        results["layouts"] = summarize_layouts(raw, specs, cfg["model"]["seq_len"])
        single = results["layouts"].get("single", {})
        params = single.get("memory_per_rank", [{}])[0].get("params", 0) // 4
        results["deepspeed_memory"] = deepspeed_formulas(results["layouts"], params) if params else []
        results["expected_comm"] = expected_communication(cfg["model"], cfg["batch_size"], cfg["microbatches"])
        print(f"[benchmarks] layouts done at {time.perf_counter() - start:.0f} s", flush=True)
    if "pipeline" in sections:
        from benchmarks.pipeline_bubble import measure as bubble

        p = cfg["pipeline"]
        rows, timelines = bubble(
            2, tuple(p["microbatches"]), p["steps"], cfg["model"], cfg["batch_size"], p["schedules"]
        )
        results["pipeline"], results["pipeline_timelines"] = rows, timelines
        print(f"[benchmarks] pipeline done at {time.perf_counter() - start:.0f} s", flush=True)
    if "memory" in sections:
        from benchmarks.memory_per_rank import measure as memory

        results["memory"] = memory(cfg["model"], cfg["batch_size"])
        print(f"[benchmarks] memory done at {time.perf_counter() - start:.0f} s", flush=True)
    if "activation" in sections:
        from benchmarks.activation_memory import measure as activation_memory

        results["activation_memory"] = activation_memory(cfg["activation"]["layouts"], cfg["activation"]["steps"])
        print(f"[benchmarks] activation checkpointing done at {time.perf_counter() - start:.0f} s", flush=True)
    if cfg["gpu"]:
        from benchmarks.gpu import run_gpu

        results["gpu"] = run_gpu(cfg["gpu_run"])
    else:
        results["gpu"] = {
            "note": "Not run (gpu=false). `benchmarks/gpu.sh` runs it on one CUDA device; without CUDA it skips."
        }
    import deepspeed

    results["meta"] = {
        "date": cfg["date"], "quick": cfg["quick"], "runtime_s": time.perf_counter() - start, "commit": _commit(),
        "command": "python -m benchmarks.run" + (" --quick" if cfg["quick"] else ""),
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} CPU cores, {'CUDA' if torch.cuda.is_available() else 'no GPU'}"
        ),
        "torch": torch.__version__, "lightning": lightning.__version__, "deepspeed": deepspeed.__version__,
        "model": cfg["model"], "batch_size": cfg["batch_size"], "steps": cfg["steps"], "warmup": cfg["warmup"],
    }
    from benchmarks.report import write_all

    out = Path(cfg["out_dir"]) / str(cfg["date"])
    written = write_all(out, results, cfg["plots"])
    print(f"[benchmarks] wrote {', '.join(str(p) for p in written)} in {results['meta']['runtime_s']:.0f} s",
          flush=True)
    return results, out


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _main(cfg: DictConfig) -> None:
    run(settings(cfg))


def main() -> None:
    """Entry point: accept ``--quick`` as well as Hydra's ``quick=true``."""
    sys.argv = _quick_flag(sys.argv)
    _main()


if __name__ == "__main__":
    main()
