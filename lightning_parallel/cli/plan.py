"""``lp-plan``: rank the layouts of a model on a cluster, from the same Hydra configs as ``lp-train``.

    lp-plan experiment=nlp_gpt trainer.devices=4                    # this machine (conf/cluster/cpu.yaml)
    lp-plan experiment=nlp_gpt trainer.devices=4 --measure 3        # and run the top 3 for a few steps
    lp-plan --shape llama3-8b --cluster h100_cluster --devices 64 \\
        scaling=fixed_global_batch scaling.reference.global_batch_size=512 data.batch_size=1
    lp-plan --shape llama3-8b --seq-len 131072 --cluster h100_node --devices 8 \\
        scaling=fixed_global_batch scaling.reference.global_batch_size=1 data.batch_size=1   # context parallel wins
    lp-plan --shape mixtral-8x7b --seq-len 4096 --cluster h100_cluster --devices 32 \\
        scaling=fixed_global_batch scaling.reference.global_batch_size=64 data.batch_size=1  # experts sharded
    lp-plan --shape path/to/config.json ...                         # a Hugging Face decoder's config values

Arguments that are not options are Hydra overrides, as for ``lp-train``. The last line printed
is the winning overrides, to paste after ``lp-train``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from lightning_parallel.planner.candidates import SearchSpace
from lightning_parallel.planner.from_config import checkpointing_modes, shape_of, workload_of
from lightning_parallel.planner.plan import Plan, make_plan, overrides
from lightning_parallel.runtime.config_dir import CONFIG_DIR


def compose(overrides_: list[str]) -> Any:
    """The config ``lp-train`` would compose from ``overrides_`` (Hydra's compose API, no run folder)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lightning_parallel.cli.run_folder import register_resolver

    register_resolver()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides_)


def measure(line: list[str], user: list[str], steps: int, timeout: float = 900) -> Optional[float]:
    """Samples/s of ``steps`` training steps of ``lp-train`` with ``user`` then ``line`` overrides (None: it failed).

    Runs the normal entry point in a subprocess (no validation, checkpoints or logger); the figure is
    :class:`~lightning_parallel.callbacks.ThroughputReport`'s, after 3 warm-up batches.
    """
    with tempfile.TemporaryDirectory(prefix="lp-plan-") as folder:
        command = [sys.executable, "-m", "lightning_parallel.cli.train", *user, *line, f"trainer.max_steps={steps}",
                   "++trainer.limit_val_batches=0", "logger=none", "callbacks=none",
                   "++trainer.enable_progress_bar=false",
                   "+callbacks.throughput._target_=lightning_parallel.callbacks.ThroughputReport",
                   "+callbacks.throughput.warmup_batches=3", f"hydra.run.dir={folder}/run"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        metrics = Path(folder) / "run" / "metrics.json"
        if done.returncode or not metrics.is_file():
            print(f"lp-plan: measuring {' '.join(line)} failed: {(done.stderr or done.stdout).strip()[-400:]}",
                  file=sys.stderr)
            return None
        return json.loads(metrics.read_text())["metrics"].get("throughput/samples_per_sec")


def _parser() -> argparse.ArgumentParser:
    from lightning_parallel.cli.help_text import DOCS, plain

    parser = argparse.ArgumentParser(
        prog="lp-plan", description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"Docs: docs/planner.md.\nEverything: {DOCS}.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for lp-train")
    parser.add_argument("--cluster", default="cpu", help="a file of conf/cluster/ (without .yaml) or a YAML path")
    parser.add_argument("--devices", type=int, help="processes in all (default: trainer.devices x trainer.num_nodes)")
    parser.add_argument("--shape", help="plan a published shape instead of the config's model: llama3-8b, "
                        "llama3-70b, mixtral-8x7b, olmoe-1b-7b, qwen3-30b-a3b, or a Hugging Face config.json path")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sample of --shape")
    parser.add_argument("--top", type=int, default=10, help="ranked rows to show")
    parser.add_argument("--measure", type=int, default=0, metavar="K",
                        help="run the top K for --steps steps and re-rank")
    parser.add_argument("--steps", type=int, default=12, help="steps per measured run (3 are warm-up)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's ZeRO stages out")
    parser.add_argument("--simulate", type=int, default=0, metavar="K",
                        help="build the top K layouts by simulation (lp-simulate) and show predicted and simulated "
                        "memory side by side")
    return parser


def plan_from_args(args: argparse.Namespace) -> tuple[Plan, Any, int]:
    """The plan the command line asks for, the composed config, and the device count per node."""
    from lightning_parallel.cli.overrides_check import check_overrides
    from lightning_parallel.cli.preflight import world_size_of
    from lightning_parallel.planner.cluster import load_cluster
    from lightning_parallel.planner.hf_shapes import named_shape
    from lightning_parallel.planner.shapes import LLAMA3, llama3_shape

    check_overrides(list(args.overrides), str(CONFIG_DIR))  # did-you-mean, as lp-train (ValueError: exit 2)
    cfg = compose(list(args.overrides))
    world = args.devices or world_size_of(cfg)
    cluster = load_cluster(args.cluster, CONFIG_DIR)
    if args.shape:
        shape = (llama3_shape if args.shape in LLAMA3 else named_shape)(args.shape, args.seq_len)
    else:
        shape = shape_of(cfg)
    checkpointing = ("none", "full", "selective") if args.shape else checkpointing_modes()
    space = SearchSpace(deepspeed_stages=() if args.no_deepspeed else (1, 2, 3), checkpointing=checkpointing)
    per_node = min(world, cluster.devices_per_node)
    if world % per_node:
        raise ValueError(f"--devices {world} is not a whole number of {cluster.name} nodes of {per_node} devices.")
    return make_plan(shape, cluster, world, workload_of(cfg), space), cfg, per_node


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point (``lp-plan``)."""
    from hydra.errors import HydraException

    from lightning_parallel.planner.table import print_plan

    args = _parser().parse_args(argv)
    try:
        plan, cfg, per_node = plan_from_args(args)
        nodes = plan.world // per_node
        work = workload_of(cfg)
        best = plan.best
    except (ValueError, HydraException) as error:  # Hydra's own: what composing the overrides refused
        print(f"lp-plan: error: {error}", file=sys.stderr)
        sys.exit(2)
    measured = None
    if args.measure:
        measured = {p.candidate.name: measure(overrides(p.candidate, work, per_node, nodes), args.overrides, args.steps)
                    for p in plan.ranked[: args.measure]}
        done = {k: v for k, v in measured.items() if v}
        if done:
            best = next(p for p in plan.ranked if p.candidate.name == max(done, key=done.get))
    line = " ".join(overrides(best.candidate, work, per_node, nodes))
    print_plan(plan, line, args.top, measured, best=best.candidate.name)
    if args.simulate and not args.shape:
        from lightning_parallel.cli.plan_simulation import print_simulated, simulate_candidates

        rows = simulate_candidates(plan, list(args.overrides), work, per_node, nodes, args.simulate, compose)
        print_simulated(rows, plan.cluster.memory_per_device)
    elif args.simulate:
        print("lp-plan: --simulate builds the config's model; --shape names no module to build (use model=...).")
    if measured and any(measured.values()):
        print(f"measured best: {best.candidate.name} (predicted rank {plan.ranked.index(best) + 1})")


if __name__ == "__main__":
    main()
