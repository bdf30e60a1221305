"""``lp-simulate``: build every rank class of a layout in torch's fake world and say what each rank holds.

    lp-simulate experiment=nlp_gpt trainer.devices=4 strategy=hybrid strategy.zero_stage=3
    lp-simulate experiment=nlp_gpt trainer.devices=8 trainer.num_nodes=512 strategy=hybrid \\
        strategy.pipeline_parallel_size=4 strategy.tensor_parallel_size=4 strategy.zero_stage=3 \\
        strategy.data_replicate_size=2 cluster=h100_cluster        # 4,096 ranks, 10 classes, 3 s
    lp-simulate model=hf_causal_lm ...                             # a Llama-3-70B shape: docs/simulation.md
    lp-simulate experiment=recsys_torchrec trainer.devices=8 trainer.num_nodes=512 cluster=h100_cluster  # TorchRec
    lp-simulate experiment=nlp_gpt strategy=deepspeed_zero3 trainer.devices=8   # DeepSpeed's partition arithmetic

The configuration is ``lp-train``'s (the same Hydra groups and overrides), checked by the same preflight: a layout
``lp-train`` refuses is refused here with the same message and exit code 2. Then the suite's real composition runs in
one CPU process, once per class of ranks that hold the same shapes, on a model built on ``meta`` (nothing the size of
the model is allocated). It prints one row per class -- parameters, gradients and optimizer state as stored (FSDP2's
padding included), FSDP2's gathered units, the predicted peak and whether it fits the cluster's device memory
(``cluster=<conf/cluster file>``; default ``cpu``) -- and writes ``simulation.json`` in a new run folder
(``outputs/<date>/<time>_<experiment>_<id>``, or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from lightning_parallel.cli.plan import compose
from lightning_parallel.cli.preflight import SETTING_NAMES, ConfigError, check_trainer_overrides, preflight, qualified
from lightning_parallel.runtime.config_dir import CONFIG_DIR

_UNIFIED_PRECISION = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed", "64": "64-true"}


def _parser() -> argparse.ArgumentParser:
    from lightning_parallel.cli.help_text import DOCS, plain

    parser = argparse.ArgumentParser(prog="lp-simulate", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"Docs: docs/simulation.md.\nEverything: {DOCS}.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for lp-train; cluster=<name> picks the "
                        "device memory to fit against")
    parser.add_argument("--cluster", default=None, help="a file of conf/cluster/ (without .yaml) or a YAML path "
                        "(the same as cluster=<name>; default: cpu)")
    parser.add_argument("--out", default=None, help="the folder for simulation.json (default: a new run folder)")
    return parser


def _split_cluster(overrides: list[str], given: Optional[str]) -> tuple[list[str], str]:
    """The overrides without ``cluster=<name>`` (not a group of lp-train's config), and the cluster's name."""
    rest, cluster = [], given
    for override in overrides:
        if override.lstrip("+").startswith("cluster="):
            cluster = override.split("=", 1)[1]
        else:
            rest.append(override)
    return rest, cluster or "cpu"


def _kind(strategy: Any) -> str:
    """``hybrid`` (a strategy with ``ParallelOptions``), ``torchrec``, ``deepspeed``, or refused (DDP, single
    device, ...)."""
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    if isinstance(getattr(strategy, "options", None), ParallelOptions):
        return "hybrid"
    if getattr(strategy, "strategy_name", None) == "torchrec":
        return "torchrec"
    if isinstance(strategy, DeepSpeedDataParallelStrategy):
        return "deepspeed"
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    raise ConfigError(f"lp-simulate simulates the hybrid strategy and its presets, TorchRec and DeepSpeed; strategy "
                      f"{name} is none of them: use strategy=hybrid (or pipeline, tensor, context) with the same "
                      "sizes.")


def run(overrides: list[str], cluster_name: str, out: Optional[str]) -> tuple[Any, Path]:
    """Check, simulate and write ``simulation.json``; returns the simulation and the file.

    Raises:
        ConfigError: what ``lp-train`` would refuse (its message), or what the simulation refuses.
    """
    from hydra.utils import instantiate

    from lightning_parallel.cli.preflight import world_size_of
    from lightning_parallel.cli.simulate_strategies import simulate_deepspeed, simulate_torchrec
    from lightning_parallel.planner.cluster import load_cluster
    from lightning_parallel.planner.simulation import simulate
    from lightning_parallel.planner.simulation.step import batch_of

    check_trainer_overrides(overrides)
    cfg = compose(overrides)
    strategy, layout = preflight(cfg)
    kind = _kind(strategy)
    try:
        cluster = load_cluster(cluster_name, CONFIG_DIR)
        precision = str(cfg.trainer.get("precision", "32-true"))
        if kind == "torchrec":
            simulation = simulate_torchrec(lambda: instantiate(cfg.model), strategy, world_size_of(cfg), cluster,
                                           cluster.memory_per_device)
        elif kind == "deepspeed":
            simulation = simulate_deepspeed(lambda: instantiate(cfg.model), strategy, world_size_of(cfg),
                                            _UNIFIED_PRECISION.get(precision, precision), cluster.memory_per_device)
        else:
            simulation = simulate(lambda: instantiate(cfg.model), strategy.options, world_size_of(cfg),
                                  num_nodes=int(cfg.trainer.num_nodes),
                                  precision=_UNIFIED_PRECISION.get(precision, precision),
                                  device_memory=cluster.memory_per_device, names=SETTING_NAMES,
                                  batch=batch_of(cfg.get("data")))
    except ValueError as exc:
        raise ConfigError(qualified(str(exc))) from exc
    simulation.settings.update(cluster=cluster.name,
                               layout_checked=layout.describe() if hasattr(layout, "describe") else None)
    folder = Path(out) if out else _run_folder(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "simulation.json"
    path.write_text(json.dumps(simulation.to_json(), indent=1))
    return simulation, path


def _run_folder(overrides: list[str]) -> Path:
    """A new run folder, named as ``lp-train`` names its own (labelled by the experiment, else ``simulate``)."""
    from lightning_parallel.cli.run_folder import run_folder

    experiment = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("experiment=")), None)
    return Path(run_folder("outputs", None, experiment, "simulate"))


def print_simulation(simulation: Any, path: Path) -> None:
    """The table (one row per class, as wide as the terminal), why ranks share a class, and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=shutil.get_terminal_size((140, 24)).columns)
    table = Table(title=f"lp-simulate: {simulation.layout}, {simulation.world_size:,} ranks, "
                        f"{len(simulation.classes)} classes", title_justify="left")
    for column in ("class", "ranks", "stages", "params MiB", "grads MiB", "optim MiB", "gathered MiB",
                   "activ. MiB", "peak MiB", "fits"):
        table.add_column(column, justify="right" if "MiB" in column else "left", overflow="fold")
    for index, row in enumerate(simulation.rows()):
        table.add_row(str(index), *row)
    console.print(table)
    for index, result in enumerate(simulation.classes):
        console.print(f"class {index} ({len(result.ranks):,} ranks): {result.why}", overflow="fold")
    for note in sorted({n for result in simulation.classes for n in result.notes}):
        console.print(f"note: {note}", overflow="fold")
    padding = max(result.padding_bytes for result in simulation.classes)
    console.print(f"FSDP2 padding: up to {padding / 2**20:,.2f} MiB per rank beyond the local shapes (in params MiB)")
    verdict = {None: "no cluster memory given", True: "fits", False: "does NOT fit"}[simulation.fits]
    for index, result in enumerate(simulation.classes):
        if result.collectives:
            calls = ", ".join(f"{c['kind']} {c['axis']} {c['count']}x {c['bytes'] / 2**20:,.1f} MiB"
                              for c in result.collectives)
            console.print(f"class {index} step collectives: {calls}", overflow="fold")
    measured = all(result.activation_bytes is not None for result in simulation.classes)
    console.print(f"whole-world check passed ({simulation.elements_checked:,} parameter elements); activations "
                  f"{'measured' if measured else 'not measured in every class (notes)'}; {verdict}; "
                  f"{simulation.seconds:.1f} s; wrote {path}")


def main(argv: Optional[list[str]] = None) -> None:
    """Console entry point (``lp-simulate``)."""
    args = _parser().parse_args(argv)
    overrides, cluster = _split_cluster(list(args.overrides), args.cluster)
    try:
        simulation, path = run(overrides, cluster, args.out)
    except ConfigError as error:
        print(f"lp-simulate: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    print_simulation(simulation, path)
    if simulation.fits is False:
        sys.exit(1)  # a layout that fits nowhere: scripts can tell


if __name__ == "__main__":
    main()
