"""``strategy=planned``: the planner picks the layout at start-up, and the run trains with it.

The choice is cached (by the model, data and scaling config, the world size and the cluster
description), so a restarted or resumed run, and every rank, trains with the same layout.
The cache is a folder of JSON files: ``$LP_PLAN_CACHE``, else ``~/.cache/lightning_parallel/plans``.

Note:
    Ranks started by ``lp-train`` receive the config after the choice is written into it. Under an
    external launcher (torchrun, SLURM) every rank starts ``lp-train`` itself: rank 0 plans, the
    others wait for its cache file, since a plan from measured times could differ between
    processes. Across nodes ``LP_PLAN_CACHE`` must then name a shared folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from lightning_parallel.planner.candidates import Candidate, SearchSpace
from lightning_parallel.planner.cluster import load_cluster
from lightning_parallel.planner.from_config import checkpointing_modes, shape_of, workload_of
from lightning_parallel.runtime.config_dir import CONFIG_DIR

PLAN_VERSION = 3  # part of the cache key: a change of the planner's arithmetic plans again


def cache_dir() -> Path:
    """Where plans are cached."""
    return Path(os.environ.get("LP_PLAN_CACHE") or Path.home() / ".cache" / "lightning_parallel" / "plans")


def cache_key(cfg: Any, world: int, cluster_name: str) -> str:
    """A digest of what decides the plan: model, data, scaling, world size, cluster description, search options."""
    from omegaconf import OmegaConf

    cluster_file = Path(cluster_name) if Path(cluster_name).suffix else CONFIG_DIR / "cluster" / f"{cluster_name}.yaml"
    parts = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "data", "scaling")}
    parts.update(world=world, cluster=cluster_file.read_text() if cluster_file.is_file() else cluster_name,
                 search=OmegaConf.to_container(cfg.strategy, resolve=True), version=PLAN_VERSION)
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plan(cfg: Any, world: int) -> dict[str, Any]:
    from lightning_parallel.planner.plan import make_plan

    options = cfg.strategy
    cluster = load_cluster(str(options.cluster), CONFIG_DIR)
    space = SearchSpace(deepspeed_stages=(1, 2, 3) if options.get("deepspeed", True) else (),
                        checkpointing=checkpointing_modes())
    plan = make_plan(shape_of(cfg), cluster, world, workload_of(cfg), space)
    best = plan.best
    return {"candidate": asdict(best.candidate), "throughput": best.throughput, "memory": best.memory.total,
            "fit": len(plan.ranked), "refused": len(plan.rejected), "cluster": cluster.name,
            "runner_up": plan.ranked[1].candidate.name if len(plan.ranked) > 1 else None,
            "runner_up_throughput": plan.ranked[1].throughput if len(plan.ranked) > 1 else None}


def _wait_for(path: Path, timeout: float = 600.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise ValueError(f"strategy=planned: rank {os.environ.get('RANK')} waited {timeout:.0f} s for rank 0's "
                             f"plan {path}; across nodes set LP_PLAN_CACHE to a folder every node shares.")
        time.sleep(0.5)
    return json.loads(path.read_text())


def cached_plan(cfg: Any, world: int) -> tuple[dict[str, Any], Path, bool]:
    """The chosen layout for ``cfg`` on ``world`` processes (planned now, or read from the cache), its file, and
    whether it came from the cache."""
    path = cache_dir() / f"{cache_key(cfg, world, str(cfg.strategy.cluster))}.json"
    if path.is_file():
        return json.loads(path.read_text()), path, True
    if os.environ.get("RANK", "0") != "0":
        return _wait_for(path), path, True
    choice = _plan(cfg, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(choice, indent=2))
    partial.replace(path)  # atomic: a waiting rank never reads half a file
    return choice, path, False


def strategy_node(c: Candidate) -> dict[str, Any]:
    """The ``strategy`` config of the candidate (the shipped ``hybrid``, ``deepspeed`` or ``ddp`` file, filled in)."""
    from omegaconf import OmegaConf

    if c.engine == "ddp":  # Lightning's DDP as shipped: data parallel over every process
        return OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "strategy" / "ddp.yaml").strategy)
    if c.engine == "deepspeed":
        node = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "strategy" / "deepspeed.yaml").strategy)
        node["zero_stage"] = c.zero
        return node
    node = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "strategy" / "hybrid.yaml").strategy)
    node.update(data_parallel_size=c.dp, pipeline_parallel_size=c.pp, tensor_parallel_size=c.tp, zero_stage=c.zero)
    if c.cp > 1:
        node.update(context_parallel_size=c.cp, context_parallel_method=c.cp_method)
    if c.ep > 1:
        node["expert_parallel_size"] = c.ep
    if c.pp > 1:
        node.update(schedule=c.schedule, stages_per_rank=c.stages_per_rank, microbatches=c.microbatches)
    if c.checkpointing != "none":
        node["activation_checkpointing"] = c.checkpointing
    if c.units_mb:
        node["bucket_size_mb"] = c.units_mb
    return node


def check_resolves(c: Candidate, node: dict[str, Any], world: int) -> None:
    """Refuse a strategy config that would not run the candidate's layout (a stale or edited plan).

    The layout comes from :func:`~lightning_parallel.strategies.resolve.resolve_layout`, the one every
    other part of the run (preflight, scaling, the data) reads.

    Args:
        c: the planned candidate.
        node: its ``strategy`` config (:func:`strategy_node`).
        world: processes in the run.

    Raises:
        ValueError: the sizes differ, naming the cache file to delete.
    """
    from hydra.utils import instantiate

    from lightning_parallel.strategies.resolve import resolve_layout

    layout = resolve_layout(partial(instantiate, node), world)
    got = (layout.data_parallel, layout.context_parallel, layout.pipeline_parallel, layout.tensor_parallel,
           layout.expert_parallel)
    if got != (c.dp, c.cp, c.pp, c.tp, c.ep):
        raise ValueError(f"strategy=planned: the plan {c.name} is data {c.dp} x context {c.cp} x pipeline {c.pp} x "
                         f"tensor {c.tp} (experts {c.ep}), but its strategy config runs data {got[0]} x context "
                         f"{got[1]} x pipeline {got[2]} x tensor {got[3]} (experts {got[4]}): delete the cached plan "
                         f"in {cache_dir()} (LP_PLAN_CACHE) to plan again.")


def plan_if_asked(cfg: Any) -> dict[str, str]:
    """Under ``strategy=planned``: put the planned layout into ``cfg`` (in place); rows for the start-up table.

    Args:
        cfg: the composed config; anything but ``strategy=planned`` is left alone (no rows).
    """
    from omegaconf import DictConfig, OmegaConf, open_dict

    from lightning_parallel.cli.preflight import world_size_of

    if not isinstance(cfg.get("strategy"), DictConfig) or not cfg.strategy.get("planned"):
        return {}
    world = world_size_of(cfg)
    choice, path, cached = cached_plan(cfg, world)
    c = Candidate(**choice["candidate"])
    node = strategy_node(c)
    check_resolves(c, node, world)
    targets = cfg.scaling.apply_to
    with open_dict(cfg):
        cfg.strategy = OmegaConf.create(node)
        OmegaConf.update(cfg, targets.micro_batch_size, c.batch_size)
    why = (f"fastest predicted of {choice['fit']} layouts that fit on {world} x {choice['cluster']} "
           f"({choice['throughput']:.4g} samples/s, {choice['memory'] / 2**20:.1f} MiB/rank; "
           f"{choice['refused']} refused)")
    if choice.get("runner_up"):
        why += f"; next: {choice['runner_up']} ({choice['runner_up_throughput']:.4g} samples/s)"
    return {"planned layout": c.name, "why": why, "plan": f"{path}{' (cached)' if cached else ''}"}
