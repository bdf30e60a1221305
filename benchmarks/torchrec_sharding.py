"""Embedding-table sharding on the DLRM recipes: TorchRec's plans against the DTensor vocabulary sharding.

    python -m benchmarks.torchrec_sharding            # 2 and 4 ranks, 2 rounds of 15 timed steps; 1 GiB limit search
    python -m benchmarks.torchrec_sharding --quick    # smaller tables, 1 round of 5 steps; 512 MiB, 1 bisection

Four designs train the same DLRM (4 dense features, 8 tables of ``ROWS`` rows x 64 columns fp32, bottom MLP 64,
top MLP 64-32-1, dot interaction) on the same synthetic single-hot Zipf click log (global batch 256), one process
per rank over gloo (:func:`lightning_parallel.testing.run_processes`), each through Lightning's ``Trainer.fit``:

* ``data_parallel``, ``table_wise``, ``column_wise`` -- ``TorchRecStrategy(sharding=...)``
  (:mod:`lightning_parallel.strategies.torchrec.strategy`) on :class:`~examples.recsys.torchrec_model.TorchRecDLRM`
  (TorchRec's ``DLRM`` over an ``EmbeddingBagCollection``); the dense part is data-parallel (256 / ranks samples
  per rank). ``column_wise`` uses ``column_shard_dim`` = 64 / ranks, so every table is cut over every rank. Sharded
  tables are updated in backward by TorchRec's fused Adagrad (touched rows only); replicated ``data_parallel``
  tables are dense parameters, their gradients all-reduced by DDP and stepped by torch's Adagrad.
* ``dtensor_vocab`` -- the original recipe :class:`~examples.recsys.model.DLRM` (``nn.Embedding`` tables, its
  ``tensor_parallel_plan()`` shards every table by vocabulary rows) under
  :class:`~lightning_parallel.strategies.HybridParallelStrategy` with ``tensor_parallel_size`` = ranks: every rank
  holds rows / ranks of each table, looks up every id of the batch against its rows and one all-reduce per table sums
  the partial vectors. There is no data parallelism left, so every rank runs the whole global batch through the
  (replicated) MLPs; the table gradients are dense over the local rows and torch's Adagrad steps every local row.

What differs between the two models, and only this: ``nn.Embedding`` fed ``(B, 8)`` ids against
``EmbeddingBag(mode=sum)`` fed a ``KeyedJaggedTensor`` with exactly one id per feature (the same vectors); the tables'
initial values (the recipe's ``N(0, 1/64)`` against TorchRec's ``U(+-1/sqrt(rows))``); the dense part seeing the global
batch on every rank (``dtensor_vocab``) against its share. The ids, labels, widths and optimizer (Adagrad, lr 0.05, no
weight decay, for the tables and the MLPs alike: TorchRec's CPU kernels fuse SGD and Adagrad, not Adam) are the same.

Measured per (ranks, design), all ranks of one launch per world size, the designs one after another (their order
rotated every round):

* Table bytes per rank: this rank's local pieces of the tables' weights and of their optimizer state (Adagrad's
  ``sum``, one per element), read from the trained modules -- a ``ShardedTensor``'s local shards, a DTensor's local
  tensor, a replica whole -- never computed; the largest over ranks. Gradients and communication buffers are not
  counted. ``formula``: the plan's weight bytes (:func:`~lightning_parallel.strategies.torchrec.sharding_plan.bytes_per_rank`;
  rows x 64 x 4 / ranks for the vocabulary sharding) x 2 for the state.
* Step time: from ``on_train_batch_start`` (after a barrier) to ``on_train_batch_end`` (backward and optimizer step
  done), the slowest rank per step, the median over the timed steps of every round after ``WARMUP`` steps.
* The largest tables that train under a per-rank memory limit, ``data_parallel`` against ``table_wise`` on 4 ranks:
  each rank limits its data segment (``RLIMIT_DATA``: heap and anonymous mappings, where torch's CPU allocator and
  fbgemm put tables) to its ``VmData`` after the imports and the click log plus ``LIMIT``, then builds and trains 3
  steps; fresh processes per probe. Rows per table double from ``START_ROWS`` until a probe fails, then bisect
  (multiples of 4096 rows). The table reports the largest size that trained and the smallest that did not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

DESIGNS = ("data_parallel", "table_wise", "column_wise", "dtensor_vocab")
WORLDS = (2, 4)
TABLES, DIM, NUM_DENSE, BATCH, WARMUP, ROW_UNIT = 8, 64, 4, 256, 3, 4096
FULL = {"rows": 2**16, "steps": 15, "rounds": 2, "limit_mib": 1024, "start_rows": 2**15, "bisect": 3}
QUICK = {"rows": 2**14, "steps": 5, "rounds": 1, "limit_mib": 512, "start_rows": 2**15, "bisect": 1}
LIMIT_DESIGNS, LIMIT_WORLD, LIMIT_STEPS = ("data_parallel", "table_wise"), 4, 3
HOW = ("How: DLRM, 8 tables x ROWS rows x 64 fp32, single-hot Zipf ids, global batch 256, Adagrad (lr 0.05) for "
       "tables and MLPs; one process per rank, gloo, Lightning Trainer.fit. TorchRec designs: TorchRecStrategy("
       "sharding=...) on TorchRecDLRM (column_wise: column_shard_dim = 64 / ranks); dtensor_vocab: the nn.Embedding "
       "recipe (examples/recsys/model.py) under HybridParallelStrategy(tensor_parallel_size=ranks). Bytes: this rank's "
       "local table weights + Adagrad state read from the trained modules, max over ranks; formula: plan weight bytes "
       "x 2. Step: batch start (after a barrier) to batch end, slowest rank, median of the timed steps after 3 "
       "warm-up steps. Limit: RLIMIT_DATA = VmData after imports and data + LIMIT per rank, 4 ranks, 3 steps, fresh "
       "processes per probe; rows per table doubled then bisected.")


def _quiet() -> None:
    """Silence the per-step and per-table warnings of TorchRec, Lightning and torch in a rank."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torchrec", "lightning", "lightning.pytorch", "torch", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)


class StepTimer(pl.Callback):
    """Seconds of every training step on this rank, each started right after a barrier."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        torch.distributed.barrier()  # ranks start together: the slowest rank's time is the step's
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self.start)


def local_bytes(value: Any) -> int:
    """Bytes this rank stores of a tensor: a ``ShardedTensor``'s local shards, a DTensor's local tensor, or a whole
    plain tensor (anything else: 0)."""
    if callable(getattr(value, "local_shards", None)):
        return sum(local_bytes(shard.tensor) for shard in value.local_shards())
    if callable(getattr(value, "to_local", None)):
        return local_bytes(value.to_local())
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _dense_state_bytes(trainer: Any, params: list[torch.Tensor]) -> int:
    """Bytes of the Trainer's (dense) optimizers' state that belongs to ``params``."""
    ids = {id(p) for p in params}
    return sum(local_bytes(v) for opt in trainer.optimizers for p, state in opt.state.items() if id(p) in ids
               for v in state.values())


def _torchrec_parts(design: str, world: int, rows: int, steps: int) -> tuple:
    """(model, data, strategy) of a TorchRec design."""
    from examples.recsys.torchrec_data import ZipfClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

    sizes = [rows] * TABLES
    model = TorchRecDLRM(num_dense=NUM_DENSE, table_sizes=sizes, embedding_dim=DIM, bottom_widths=(64,),
                         top_widths=(64, 32), optimizer=partial(torch.optim.Adagrad, lr=0.05),
                         table_optimizer="adagrad", table_lr=0.05)
    data = ZipfClickDataModule(table_sizes=sizes, num_dense=NUM_DENSE, max_ids_per_feature=1,
                               train_samples=steps * BATCH, val_samples=8, batch_size=BATCH // world, shuffle=False)
    shard_dim = {"column_shard_dim": DIM // world} if design == "column_wise" else {}
    return model, data, TorchRecStrategy(sharding=design, **shard_dim)


def _dtensor_parts(world: int, rows: int, steps: int) -> tuple:
    """(model, data, strategy) of the DLRM recipe under tensor parallelism: the same click log, single-hot."""
    import numpy as np
    from torch.utils.data import TensorDataset

    from examples.recsys.model import DLRM
    from examples.recsys.torchrec_data import make_click_log
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.models import FixedOrderData

    sizes = [rows] * TABLES
    model = DLRM(num_dense=NUM_DENSE, table_sizes=sizes, embedding_dim=DIM, bottom_widths=(64,), top_widths=(64, 32),
                 optimizer=partial(torch.optim.Adagrad, lr=0.05), weight_decay=0.0)
    log = make_click_log(steps * BATCH, sizes, num_dense=NUM_DENSE, max_ids_per_feature=1, seed=0)  # as the TorchRec
    samples = TensorDataset(torch.from_numpy(log.dense), torch.from_numpy(np.stack(log.values, axis=1)),
                            torch.from_numpy(log.labels))
    return model, FixedOrderData(samples, batch_size=BATCH), HybridParallelStrategy(tensor_parallel_size=world)


def table_bytes(design: str, model: Any, strategy: Any, trainer: Any, world: int, rows: int) -> dict[str, int]:
    """This rank's table weights and their optimizer state (bytes read from the trained modules), and the formula."""
    if design == "dtensor_vocab":
        params = [p for name, p in model.named_parameters() if name.startswith("embeddings.")]
        weights = sum(local_bytes(p) for p in params)
        state = _dense_state_bytes(trainer, params)
        formula = 2 * TABLES * -(-rows // world) * DIM * 4
        return {"weights": weights, "state": state, "formula": formula}
    from lightning_parallel.strategies.torchrec.sharding_plan import bytes_per_rank

    collection = model.dlrm.sparse_arch.embedding_bag_collection
    weights = sum(local_bytes(v) for k, v in collection.state_dict().items() if k.endswith(".weight"))
    fused = sum(local_bytes(v) for state in strategy.dmp.fused_optimizer.state.values() for v in state.values())
    state = fused + _dense_state_bytes(trainer, list(collection.parameters()))  # replicas: the dense optimizer's
    formula = 2 * bytes_per_rank(strategy.plan_table)[torch.distributed.get_rank()]
    return {"weights": weights, "state": state, "formula": formula}


def build(design: str, world: int, rows: int, steps: int) -> tuple:
    """(model, data, strategy) of ``design`` with ``rows`` per table and ``steps`` batches of data."""
    if design == "dtensor_vocab":
        return _dtensor_parts(world, rows, steps)
    return _torchrec_parts(design, world, rows, steps)


def fit_parts(design: str, parts: tuple, world: int, rows: int, steps: int) -> dict[str, Any]:
    """Fit ``parts`` (from :func:`build`) for ``steps`` steps in this rank; its step seconds and table bytes."""
    from lightning_parallel.testing.fit import quiet_trainer

    model, data, strategy = parts
    clock = StepTimer()
    trainer = quiet_trainer(world, strategy, steps, [clock], limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    return {"seconds": clock.seconds, "steps": trainer.global_step,
            "bytes": table_bytes(design, model, strategy, trainer, world, rows)}


def timing_rank(rank: int, world: int, rows: int, steps: int, order: list[str]) -> dict[str, Any]:
    """One launch: every design of ``order`` fitted in turn in the same processes."""
    import gc

    _quiet()
    out = {}
    for design in order:
        pl.seed_everything(0, verbose=False)
        out[design] = fit_parts(design, build(design, world, rows, WARMUP + steps), world, rows, WARMUP + steps)
        gc.collect()
    return out


def _vm_data_bytes() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmData")) * 1024


def probe_rank(rank: int, world: int, design: str, rows: int, limit_mib: int) -> dict[str, Any]:
    """Train ``design`` with ``rows`` per table for a few steps under ``VmData now + limit_mib`` (``RLIMIT_DATA``)."""
    import resource

    _quiet()
    pl.seed_everything(0, verbose=False)
    parts = build(design, world, rows, LIMIT_STEPS)  # imports done and nothing allocated (tables come in fit)
    parts[1].setup("fit")  # the click log before the limit: the same small log for every design
    baseline, baseline_peak = _vm_data_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (baseline + (limit_mib << 20), hard))
    result = fit_parts(design, parts, world, rows, LIMIT_STEPS)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; the peak only grows, hence fresh processes
    return {"steps": result["steps"], "bytes": result["bytes"], "added_mib": (_vm_data_bytes() - baseline) / 2**20,
            "peak_rss_added_mib": (peak - baseline_peak) / 1024}


def _probe(design: str, rows: int, limit_mib: int) -> dict[str, Any]:
    """One probe in fresh processes: did ``rows`` per table train ``LIMIT_STEPS`` steps under the limit?"""
    from lightning_parallel.testing import DistributedRunError, run_processes

    started = time.perf_counter()
    record: dict[str, Any] = {"rows": rows, "table_mib": TABLES * rows * DIM * 4 / 2**20}
    try:
        ranks = run_processes(probe_rank, LIMIT_WORLD, design, rows, limit_mib, timeout=600)
        record.update(ok=all(r["steps"] == LIMIT_STEPS for r in ranks), added_mib=max(r["added_mib"] for r in ranks),
                      peak_rss_added_mib=max(r["peak_rss_added_mib"] for r in ranks))
    except DistributedRunError as error:  # a rank past its limit fails the probe, whatever its message
        record.update(ok=False, error=_failure(str(error)))
    record["wall_s"] = time.perf_counter() - started
    print(f"[torchrec_sharding] limit {limit_mib} MiB, {design}, {rows} rows/table ({record['table_mib']:.0f} MiB): "
          f"{'trained' if record['ok'] else 'failed'} in {record['wall_s']:.0f} s", flush=True)
    return record


def _failure(message: str) -> str:
    """The line of a rank's traceback that says why it failed (the allocation it was refused, in MiB)."""
    asked = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", message)
    if asked:
        return f"can't allocate memory ({int(asked.group(1)) / 2**20:.0f} MiB asked)"
    lines = [line for line in message.splitlines() if "Error" in line or "alloc" in line]
    return (lines[-1] if lines else message.splitlines()[0])[:200]


def largest_under_limit(design: str, limit_mib: int, start_rows: int, bisect: int) -> dict[str, Any]:
    """Rows per table doubled from ``start_rows`` until a probe fails, then ``bisect`` halvings of the gap."""
    probes: list[dict] = []
    good, bad, rows = 0, None, start_rows
    while bad is None and rows <= 2**22:  # 8 GiB of tables: past any limit this box can lend 4 ranks
        probes.append(_probe(design, rows, limit_mib))
        good, bad, rows = (rows, None, 2 * rows) if probes[-1]["ok"] else (good, rows, rows)
    for _ in range(bisect if bad is not None else 0):
        mid = (good + bad) // 2 // ROW_UNIT * ROW_UNIT
        if mid in (good, bad):
            break
        probes.append(_probe(design, mid, limit_mib))
        good, bad = (mid, bad) if probes[-1]["ok"] else (good, mid)
    passed = next((p for p in probes if p["rows"] == good), None)
    return {"design": design, "world": LIMIT_WORLD, "limit_mib": limit_mib, "largest_rows": good,
            "largest_table_mib": TABLES * good * DIM * 4 / 2**20, "failed_rows": bad,
            "failed_table_mib": None if bad is None else TABLES * bad * DIM * 4 / 2**20,
            "added_mib": passed and passed.get("added_mib"),
            "peak_rss_added_mib": passed and passed.get("peak_rss_added_mib"),
            "error": next((p.get("error") for p in probes if p["rows"] == bad), None), "probes": probes}


def _timing_row(world: int, design: str, launches: list[list[dict]]) -> dict[str, Any]:
    """One row from every launch's per-rank results: the slowest rank per timed step, bytes of the largest rank."""
    steps: list[float] = []
    for per_rank in launches:
        seconds = [r[design]["seconds"][WARMUP:] for r in per_rank]
        steps += [max(step) for step in zip(*seconds)]
    ranks = [r[design]["bytes"] for r in launches[0]]
    return {"world": world, "design": design, "weights_per_rank": [r["weights"] for r in ranks],
            "state_per_rank": [r["state"] for r in ranks], "formula_per_rank": [r["formula"] for r in ranks],
            "bytes": max(r["weights"] + r["state"] for r in ranks), "weights": max(r["weights"] for r in ranks),
            "state": max(r["state"] for r in ranks), "formula": max(r["formula"] for r in ranks),
            "step_s": statistics.median(steps), "steps_s": steps}


def measure_times(rows: int, steps: int, rounds: int) -> list[dict]:
    """One row per (world, design): table bytes per rank, median step, both as ratios to ``data_parallel``."""
    from lightning_parallel.testing import run_processes

    launches: dict[int, list] = {w: [] for w in WORLDS}
    for round_ in range(rounds):
        order = [DESIGNS[(i + round_) % len(DESIGNS)] for i in range(len(DESIGNS))]  # no design always first
        for world in WORLDS:
            started = time.perf_counter()
            launches[world].append(run_processes(timing_rank, world, rows, steps, order, timeout=1800))
            print(f"[torchrec_sharding] round {round_ + 1}/{rounds} world {world}: "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    rows_out = [_timing_row(w, d, launches[w]) for w in WORLDS for d in DESIGNS]
    for r in rows_out:
        same = next(x for x in rows_out if x["world"] == r["world"] and x["design"] == "data_parallel")
        r["bytes_vs_data_parallel"] = r["bytes"] / same["bytes"]
        r["time_vs_data_parallel"] = r["step_s"] / same["step_s"]
    return rows_out


def render(rows: list[dict], limits: list[dict], table_rows: int) -> str:
    """Two markdown tables: bytes and step time per (ranks, design); the largest tables under the memory limit."""
    mib = lambda v: f"{v / 2**20:.1f}"  # noqa: E731
    lines = [f"Tables: {TABLES} x {table_rows} rows x {DIM} fp32 = {TABLES * table_rows * DIM * 4 / 2**20:.0f} MiB.",
             "", "| ranks | design | table weights MiB/rank | Adagrad state MiB/rank | total MiB/rank | formula MiB | "
             "vs data_parallel | step ms (median, slowest rank) | vs data_parallel |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['design']} | {mib(r['weights'])} | {mib(r['state'])} | {mib(r['bytes'])} | "
                     f"{mib(r['formula'])} | {r['bytes_vs_data_parallel']:.2f}x | {r['step_s'] * 1e3:.0f} | "
                     f"{r['time_vs_data_parallel']:.2f}x |")
    lines += ["", "| design | ranks | limit added per rank | largest tables that trained (rows/table, total MiB) | "
              "VmData / peak RSS added (max rank) | smallest that failed | failure | probes |", "|---" * 8 + "|"]
    for r in limits:
        failed = "-" if r["failed_rows"] is None else f"{r['failed_rows']} ({r['failed_table_mib']:.0f} MiB)"
        added = "-" if not r["added_mib"] else f"{r['added_mib']:.0f} / {r['peak_rss_added_mib']:.0f} MiB"
        lines.append(f"| {r['design']} | {r['world']} | {r['limit_mib']} MiB | {r['largest_rows']} "
                     f"({r['largest_table_mib']:.0f} MiB) | {added} | {failed} | {r['error'] or '-'} | "
                     f"{len(r['probes'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller tables, 1 round of 5 steps, 512 MiB limit")
    parser.add_argument("--skip-limit", action="store_true", help="only bytes and step times")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    start = time.perf_counter()
    rows = measure_times(settings["rows"], settings["steps"], settings["rounds"])
    search = partial(largest_under_limit, limit_mib=settings["limit_mib"], start_rows=settings["start_rows"],
                     bisect=settings["bisect"])
    limits = [] if args.skip_limit else [search(design) for design in LIMIT_DESIGNS]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"settings": settings, "quick": args.quick, "how": HOW, "runtime_s": time.perf_counter() - start,
            "torch": torch.__version__, "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg(),
            "tables": TABLES, "dim": DIM, "batch": BATCH, "warmup": WARMUP}
    table = render(rows, limits, settings["rows"])
    (args.out / "torchrec_sharding.json").write_text(json.dumps({"meta": meta, "rows": rows, "limits": limits},
                                                                indent=2))
    (args.out / "torchrec_sharding.md").write_text(f"# TorchRec sharding\n\n{HOW}\n\n{table}\n")
    print(table)
    print(f"[torchrec_sharding] wrote {args.out}/torchrec_sharding.json and .md in {meta['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
