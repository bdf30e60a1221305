"""Trainer + strategy against the raw loop it wraps, alternating step by step in one process group.

For every layout, :func:`run_layouts` fits the GPT recipe with the strategy and, from a
callback, runs one step of the matching raw loop (:mod:`benchmarks.raw_loops`) after
each Trainer step: A B A B on the same ranks, so machine noise hits both sides alike.
Measured per layout (rank-local, aggregated by the caller):

* step times: Trainer = time between consecutive ``on_train_batch_start`` minus the time
  spent in the callback's raw step; raw = the raw step including its ``next(loader)``;
* start-up: ``fit()`` called to the first ``on_train_batch_start`` (raw: parallelising
  plus optimizer construction);
* memory: parameter/gradient/optimizer bytes held on the rank (before the last optimizer
  step for gradients, after training for the rest);
* communication: one extra step on each side inside a :class:`~benchmarks.comm.CommCounter`
  (not timed);
* losses of both sides every step and a validation loss after training (same samples).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

from benchmarks.comm import CommCounter, ddp_buckets
from benchmarks.raw_loops import RAW_LOOPS, deepspeed_bytes, module_bytes


def gpt_datasets(model: dict, data: dict) -> tuple[Any, Any]:
    """The recipe's byte windows (Python's standard library source): a fixed train prefix and val set."""
    from examples.nlp.data import ByteWindows, load_corpus

    train, val = load_corpus(None, max_bytes=data["max_bytes"], val_every=10)
    return (Subset(ByteWindows(train, model["seq_len"]), range(data["train_samples"])),
            Subset(ByteWindows(val, model["seq_len"]), range(data["val_samples"])))


def loader(dataset: Any, batch_size: int, replicas: int, rank: int) -> DataLoader:
    """Fixed order, sharded over data-parallel ranks: batch i of all ranks is samples [i*b*d, (i+1)*b*d)."""
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def planned_gpt_class() -> type:
    """The GPT recipe with the same tensor-parallel plan applied in ``configure_model`` (for Lightning's
    ``ModelParallelStrategy``, the anchor of ``tensor_parallel``)."""
    from examples.nlp.model import GPT
    from lightning_parallel.adapters import adapt
    from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel, concrete_plan

    class PlannedGPT(GPT):
        """GPT that shards itself over ``device_mesh["tensor_parallel"]`` with its own plan."""

        def configure_model(self) -> None:
            super().configure_model()  # the recipe's layers (built already by _new_model)
            if not getattr(self, "_planned", False):
                adapter = adapt(self)
                plan = concrete_plan(self, None, adapter=adapter)
                apply_tensor_parallel(self, self.device_mesh["tensor_parallel"], plan, adapter)
                self._planned = True

    return PlannedGPT


def make_strategy(kind: str, world: int, args: dict) -> tuple[Any, int]:
    """``(strategy, data-parallel size)`` for a layout kind."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_parallel.strategies import (
        DeepSpeedDataParallelStrategy,
        HybridParallelStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
    )

    if kind == "single":
        return "auto", 1
    if kind == "ddp":
        return "ddp", world
    if kind == "pipeline":
        return PipelineParallelStrategy(**args), 1
    if kind == "tensor":
        return TensorParallelStrategy(**args), 1
    if kind == "deepspeed":
        return DeepSpeedDataParallelStrategy(**args), world
    if kind == "hybrid":  # the suite's data axis (FSDP2: replicated for ZeRO 0, sharded for 2/3)
        return HybridParallelStrategy(**args), int(args.get("data_parallel_size", world))
    if kind == "lightning_model_parallel":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world), 1
    if kind == "lightning_fsdp":  # Lightning's FSDPStrategy (torch's FSDP1), full sharding, one unit per layer
        from lightning.pytorch.strategies import FSDPStrategy

        from examples.transformer import Block

        return FSDPStrategy(auto_wrap_policy={Block}, **args), world
    raise ValueError(
        f"Unknown strategy kind {kind!r}: use single, ddp, pipeline, tensor, hybrid, deepspeed, "
        "lightning_model_parallel or lightning_fsdp."
    )


class Alternate(pl.Callback):
    """After every Trainer step, one raw step; records times, losses, memory and communication.

    Args:
        raw: the raw loop (built on ``on_train_start``).
        raw_batches: iterator over the raw loop's batches (same order as the Trainer's).
        count_step: the Trainer step (0-based) run inside a communication counter (and its raw twin).
    """

    def __init__(self, raw: Any, raw_batches: Any, count_step: int) -> None:
        self.raw, self.raw_batches, self.count_step = raw, raw_batches, count_step
        self.fit_called = 0.0
        self.startup = 0.0
        self.trainer_times: list[float | None] = []
        self.raw_times: list[float | None] = []
        self.trainer_losses: list[float] = []
        self.raw_losses: list[float] = []
        self.memory: dict = {}
        self.raw_memory: dict = {}
        self.comm: dict = {}
        self.raw_comm: dict = {}
        self._last_start: float | None = None
        self._in_callback = 0.0
        self._counter: CommCounter | None = None
        self.ddp_buckets: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.raw.build(trainer.strategy)

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_start is None:
            self.startup = now - self.fit_called - self.raw.build_seconds
        else:
            excluded = batch_idx - 1 == self.count_step
            self.trainer_times.append(None if excluded else now - self._last_start - self._in_callback)
        self._in_callback = 0.0
        if batch_idx == self.count_step:
            self._counter = CommCounter().__enter__()
        self._last_start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.count_step - 1:  # the step before counting: nothing else runs in it
            self.memory = _strategy_memory(trainer, module)
            if isinstance(trainer.strategy.model, torch.nn.parallel.DistributedDataParallel):
                self.ddp_buckets = ddp_buckets(trainer.strategy.model)

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        entered = time.perf_counter()
        counting = self._counter is not None
        if counting:
            self._counter.__exit__(None, None, None)
            self.comm = self._counter.summary()
            self._counter = None
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.trainer_losses.append(float(loss.detach()) * trainer.accumulate_grad_batches)
        counter = CommCounter().__enter__() if counting else None
        self.raw.capture_memory = batch_idx == self.count_step - 1
        start = time.perf_counter()
        self.raw_losses.append(self.raw.step(next(self.raw_batches)))
        elapsed = time.perf_counter() - start
        if counter is not None:
            counter.__exit__(None, None, None)
            self.raw_comm = counter.summary()
        self.raw_times.append(None if counting else elapsed)
        if batch_idx == self.count_step - 1:
            self.raw_memory = self.raw.captured
        self._in_callback = time.perf_counter() - entered


def _strategy_memory(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    engine = getattr(trainer.strategy, "deepspeed_engine", None) if hasattr(trainer.strategy, "config") else None
    if engine is not None:
        return deepspeed_bytes(engine)
    optimizer = trainer.optimizers[0]
    return module_bytes(module, getattr(optimizer, "_optimizer", optimizer))


def _median(values: list[float | None], skip: int) -> float:
    kept = [v for v in values[skip:] if v is not None]
    return statistics.median(kept) if kept else float("nan")


def _paired(a: list[float | None], b: list[float | None], skip: int) -> float:
    pairs = [x - y for x, y in list(zip(a, b))[skip:] if x is not None and y is not None]
    return statistics.median(pairs) if pairs else float("nan")


def _new_model(model_kwargs: dict, cls: Any = None) -> Any:
    from examples.nlp.model import GPT

    torch.manual_seed(0)
    model = (cls or GPT)(**model_kwargs)
    GPT.configure_model(model)  # the recipe's layers, with storage and seeded (a subclass may add to its hook)
    return model


def _trainer_layout(rank: int, world: int, spec: dict, cfg: dict, train: Any, val: Any) -> dict:
    strategy, dp = make_strategy(spec["strategy"], world, dict(spec.get("args", {})))
    per_rank = cfg["batch_size"] // dp
    steps = cfg["warmup"] + cfg["steps"]
    raw_args = dict(spec.get("raw_args", {}))
    raw = RAW_LOOPS[spec["raw"]](_new_model(cfg["model"]), rank, world, **raw_args)
    dp_rank = rank if dp > 1 else 0
    raw_batches = iter(loader(train, per_rank, dp, dp_rank))
    alternate = Alternate(raw, raw_batches, count_step=steps)
    cls = planned_gpt_class() if spec["strategy"] == "lightning_model_parallel" else None
    model = _new_model(cfg["model"], cls)
    # As lp-train runs every strategy: with GracefulStop, whose stop agreement (every ~1 s) stands in for
    # Lightning's broadcast of its SIGTERM flag before every step.
    from lightning_parallel.callbacks.graceful_stop import GracefulStop

    stop = GracefulStop(tempfile.mkdtemp(prefix="lp-bench-stop-"))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps + 1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, num_sanity_val_steps=0,
                         callbacks=[alternate, stop])
    alternate.fit_called = time.perf_counter()
    trainer.fit(model, train_dataloaders=loader(train, per_rank, dp, dp_rank))
    val_loader = loader(val, per_rank, dp, dp_rank)
    val_loss = trainer.validate(model, dataloaders=val_loader, verbose=False)[0]["val_loss"]
    raw_val = raw.val_loss(list(val_loader))
    extra = {}
    if spec["strategy"] == "ddp":
        extra = {"ddp_buckets_bytes": alternate.ddp_buckets, "raw_ddp_buckets_bytes": raw.ddp_all_reduces()}
    skip = cfg["warmup"]
    return {
        "trainer_ms": 1e3 * _median(alternate.trainer_times, skip),
        "raw_ms": 1e3 * _median(alternate.raw_times, skip),
        "paired_overhead_ms": 1e3 * _paired(alternate.trainer_times, alternate.raw_times, skip),
        "steps_timed": sum(v is not None for v in alternate.trainer_times[skip:]),
        "startup_s": alternate.startup, "raw_startup_s": raw.build_seconds,
        "trainer_losses": alternate.trainer_losses, "raw_losses": alternate.raw_losses,
        "val_loss": float(val_loss), "raw_val_loss": raw_val,
        "memory": alternate.memory, "raw_memory": alternate.raw_memory,
        "comm": alternate.comm, "raw_comm": alternate.raw_comm, **extra,
        "samples": cfg["batch_size"] * (steps + 1), "global_batch": cfg["batch_size"],
    }


def _loop_layout(rank: int, world: int, spec: dict, cfg: dict, train: Any, val: Any) -> dict:
    """Two raw loops alternating (an anchor that has no Lightning strategy, e.g. DeepSpeed's pipeline engine)."""
    steps = cfg["warmup"] + cfg["steps"]
    anchor = RAW_LOOPS[spec["anchor"]](_new_model(cfg["model"]), rank, world, **dict(spec.get("anchor_args", {})))
    raw = RAW_LOOPS[spec["raw"]](_new_model(cfg["model"]), rank, world, **dict(spec.get("raw_args", {})))
    start = time.perf_counter()
    anchor.build()
    startup = time.perf_counter() - start
    raw.build()
    a_batches = iter(loader(train, cfg["batch_size"], 1, 0))
    b_batches = iter(loader(train, cfg["batch_size"], 1, 0))
    times: dict[str, list] = {"a": [], "b": []}
    losses: dict[str, list] = {"a": [], "b": []}
    for step in range(steps + 1):  # + 1: the same samples as a Trainer layout (which runs a counted step)
        for side, loop, batches in (("a", anchor, a_batches), ("b", raw, b_batches)):
            batch = next(batches)
            t0 = time.perf_counter()
            losses[side].append(loop.step(batch))
            times[side].append(time.perf_counter() - t0)
            if side == "a" and step == 0:
                startup += times["a"][0]
    val_batches = list(loader(val, cfg["batch_size"], 1, 0))
    skip = cfg["warmup"]
    return {
        "trainer_ms": 1e3 * _median(times["a"], skip), "raw_ms": 1e3 * _median(times["b"], skip),
        "paired_overhead_ms": 1e3 * _paired(times["a"], times["b"], skip), "steps_timed": len(times["a"]) - skip,
        "startup_s": startup, "raw_startup_s": raw.build_seconds,
        "trainer_losses": losses["a"], "raw_losses": losses["b"],
        "val_loss": anchor.val_loss(val_batches), "raw_val_loss": raw.val_loss(val_batches),
        "memory": anchor.memory(), "raw_memory": raw.memory(), "comm": {}, "raw_comm": {},
        "samples": cfg["batch_size"] * (steps + 1), "global_batch": cfg["batch_size"],
    }


def _worker(rank: int, world: int, specs: list[dict], cfg: dict) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if world > 1:
        dist.init_process_group("gloo")
    train, val = gpt_datasets(cfg["model"], cfg["data"])
    results = {}
    for spec in specs:
        runner = _loop_layout if "anchor" in spec else _trainer_layout
        try:
            results[spec["name"]] = runner(rank, world, spec, cfg, train, val)
        except Exception as err:  # noqa: BLE001 - a layout that cannot run is a result (with its reason), not a crash
            results[spec["name"]] = {"error": f"{type(err).__name__}: {err}"[:500]}
        if world > 1:
            dist.barrier()
    return results


def run_layouts(specs: list[dict], cfg: dict, timeout: float = 1200) -> dict[str, list[dict]]:
    """Run every layout spec, grouped by world size; returns ``{name: [per-rank result]}``.

    Args:
        specs: layout specs (``name``, ``world``, ``strategy``, ``raw``, optional ``args``/``raw_args``,
            or ``anchor``/``anchor_args`` for a raw-vs-raw comparison).
        cfg: ``model``, ``data``, ``batch_size`` (global), ``warmup``, ``steps``.
        timeout: seconds per group of processes.
    """
    from lightning_parallel.testing import run_processes

    out: dict[str, list[dict]] = {}
    for world in sorted({s["world"] for s in specs}):
        group = [s for s in specs if s["world"] == world]
        per_rank = run_processes(_worker, world, group, cfg, timeout=timeout, env={"PYTHONWARNINGS": "ignore"})
        for spec in group:
            out[spec["name"]] = [r[spec["name"]] for r in per_rank]
    return out
