"""Context parallelism on the GPT recipe: activation memory, step time and bytes sent per rank against the context size.

    python -m benchmarks.context_parallel            # seq 2048, cp 1 / 2 / 4, ring and Ulysses, 2 rounds
    python -m benchmarks.context_parallel --quick    # seq 1024, 1 round, smaller search (< 3 minutes)
    python -m benchmarks.context_parallel --seq 4096 --budget-mib 48 --out /tmp/cp

The GPT recipe (width 64, 2 blocks, 4 heads, bytes, no dropout) on one sample of ``--seq`` tokens is
parallelised by :func:`~lightning_parallel.parallel.compose.parallelize` with a context axis of 1, 2
and 4 ranks (gloo, one process per rank through :func:`lightning_parallel.testing.run_processes`) and
trained by a raw loop (forward, backward, AdamW step; the loss is each rank's token mean, exact here
since every rank holds the same number of tokens). Under cp > 1 both methods are built in the same
processes and take turns step by step (ring, ulysses, ring, ...); the cp sizes run in turns too
(cp1, cp2, cp4 per round), so a change in the machine's load affects them alike.

* Activation memory, per rank: the bytes autograd saves for backward over one forward (and the loss),
  as ``saved_tensors_hooks`` sees them: the storages of the saved tensors, each once, parameters
  excluded (a saved tensor whose base is a leaf that requires grad). Also the peak resident memory of
  each rank's process (``ru_maxrss``: libraries, both methods' models and every step; context only).
* Step time: the slowest rank's, median over the timed steps.
* Bytes sent per step by the context collectives, per rank, counted: ``dist.batch_isend_irecv`` (the
  ring's send/recv; the bytes of its send operations) and ``dist.all_to_all_single`` (Ulysses; the
  ``(cp - 1) / cp`` of its input that goes to other ranks) are wrapped for one training step. Shown
  next to the planner's formula (:func:`lightning_parallel.planner.context.sent_bytes`) for the same
  shapes. The gradient all-reduce over the context group (parameters are replicated) is not counted.
* Longest sequence under a per-rank budget: from ``--search-from`` tokens, doubling, the longest
  sequence whose saved activations (max over ranks) stay within ``--budget-mib``; a full training step
  is then run at that length (it trains).

Note:
    What a context rank saves beyond ``1 / cp`` of one process (measured here: 5.3% of its share,
    at cp 2 and 4, both methods): one ``[s_local, d_model]`` tensor per attention layer. One process's
    CPU flash SDPA returns its output ``[b, s, h, d]``-strided, so the ``transpose(1, 2).reshape`` before
    the output projection is a view of the tensor SDPA saves; the context kernels return head-major
    contiguous outputs, and that reshape copies (the projection saves the copy). Plus the inputs and
    targets as two storages (one process slices both from one token tensor).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any, Iterator

import torch

MODEL = {"vocab_size": 256, "d_model": 64, "n_layer": 2, "n_head": 4, "dropout": 0.0}
METHODS = ("ring", "ulysses")
SIZES = (1, 2, 4)
FULL = {"seq": 2048, "steps": 5, "rounds": 2, "budget_mib": 24.0, "search_from": 512, "search_to": 16384}
QUICK = {"seq": 1024, "steps": 2, "rounds": 1, "budget_mib": 12.0, "search_from": 512, "search_to": 8192}
HOW = ("How: GPT recipe (d_model 64, 2 blocks, 4 heads, vocab 256, batch 1) parallelised with a context axis of cp "
       "ranks (gloo, one process each, on this machine's cores); raw loop forward + backward + AdamW. Memory: bytes "
       "autograd saves for backward over one forward + loss (unique storages, parameters excluded), per rank. Time: "
       "median step of the slowest rank; methods alternate step by step inside a launch, cp sizes launch in turns "
       "per round. Bytes: counted sends of the ring's batch_isend_irecv and the (cp-1)/cp of all_to_all_single "
       "inputs that leave the rank, over one training step, per rank; 'formula' is the planner's "
       "(lightning_parallel.planner.context.sent_bytes) for 2 attention modules.")


class SavedBytes:
    """Bytes of the storages autograd saves while active (each storage once; parameters and their views excluded)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.kinds: dict[str, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        root = t
        while root._base is not None:
            root = root._base
        if root.is_leaf and root.requires_grad:  # a parameter (FSDP2's unsharded copy included), or a view of one
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.storages:
            self.storages[storage.data_ptr()] = storage.nbytes()
            key = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            self.kinds[key] = self.kinds.get(key, 0) + storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


@contextmanager
def counted_sends() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends to other ranks through the context kernels' collectives while active.

    ``torch.distributed.batch_isend_irecv`` (ring attention's send/recv: the sends' bytes) and
    ``all_to_all_single`` (Ulysses: equal pieces, all but this rank's own leave) are wrapped; the
    kernels look them up on the module at call time.
    """
    import torch.distributed as dist

    counts = {"p2p": 0, "all_to_all": 0, "calls": 0}
    batch, all_to_all = dist.batch_isend_irecv, dist.all_to_all_single

    def counting_batch(ops: list) -> Any:
        counts["calls"] += 1
        counts["p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    def counting_all_to_all(output: torch.Tensor, input: torch.Tensor, *args: Any, group: Any = None,
                            **kwargs: Any) -> Any:
        n = dist.get_world_size(group)
        counts["calls"] += 1
        counts["all_to_all"] += input.numel() * input.element_size() * (n - 1) // n
        return all_to_all(output, input, *args, group=group, **kwargs)

    dist.batch_isend_irecv, dist.all_to_all_single = counting_batch, counting_all_to_all
    try:
        yield counts
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = batch, all_to_all


def _build(rank: int, world: int, method: str, seq_max: int) -> tuple:
    """The GPT parallelised over ``world`` context ranks with ``method``: ``(module, optimizer, split)``."""
    from examples.nlp.model import GPT
    from lightning_parallel.adapters import adapt
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.layout.meshes import RunMeshes
    from lightning_parallel.parallel.compose import parallelize
    from lightning_parallel.parallel.options import ParallelOptions

    layout = ParallelLayout(world, 1, 1, 1, context_parallel=world)
    meshes = RunMeshes.build(layout, "cpu")
    options = ParallelOptions(1, 1, 1, context_parallel_size=world, context_parallel_method=method)
    torch.manual_seed(0)
    module = GPT(seq_len=seq_max, **MODEL).build()
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    split = result.context_split.split_batch if result.context_split is not None else (lambda batch: batch)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3), split


def _tokens(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _step(run: tuple, seq: int, memory: bool = False) -> dict[str, Any]:
    """One training step on ``seq`` tokens: seconds (slowest rank), and with ``memory`` the saved bytes and sends."""
    import torch.distributed as dist

    module, optimizer, split = run
    x, y = split(_tokens(seq))
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    out: dict[str, Any] = {}
    if memory:
        with counted_sends() as sent:
            with SavedBytes() as saved:
                loss = module.pipeline_loss(module(x), y)
            loss.backward()
        out.update(saved=saved.total, top=sorted(saved.kinds.items(), key=lambda kv: -kv[1])[:6], sent=dict(sent))
    else:
        module.pipeline_loss(module(x), y).backward()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    out["seconds"] = float(elapsed)
    return out


def _forward_saved(run: tuple, seq: int) -> int:
    """Saved bytes of one forward on ``seq`` tokens, the most of any rank (the graph is dropped unused)."""
    import torch.distributed as dist

    module, _, split = run
    x, y = split(_tokens(seq))
    with SavedBytes() as saved:
        loss = module.pipeline_loss(module(x), y)
    del loss
    most = torch.tensor([saved.total], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)


def _longest(run: tuple, budget: float, start: int, stop: int) -> dict[str, Any]:
    """The longest of ``start, 2 start, ... <= stop`` tokens whose saved activations fit ``budget`` bytes per rank,
    checked by training one step at it."""
    best, seq, tried = None, start, []
    while seq <= stop:
        saved = _forward_saved(run, seq)
        tried.append((seq, saved))
        if saved > budget:
            break
        best, seq = seq, seq * 2
    trains = best is not None and _step(run, best)["seconds"] > 0
    return {"longest": best, "tried": tried, "trains": trains, "hit_search_limit": best is not None and seq > stop}


def _rank(rank: int, world: int, seq: int, steps: int, search: dict | None) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seq_max = max(seq, search["stop"] if search else seq)
    methods = METHODS if world > 1 else ("-",)
    runs = {m: _build(rank, world, "ring" if m == "-" else m, seq_max) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    memory: dict[str, dict] = {}
    for index in range(steps + 2):  # a warm-up step, a memory step, then the timed steps
        for m, run in runs.items():
            result = _step(run, seq, memory=index == 1)
            if index == 1:
                memory[m] = result
            elif index >= 2:
                times[m].append(result["seconds"])
    longest = {m: _longest(run, search["budget"], search["start"], search["stop"]) for m, run in runs.items()} \
        if search else {}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    dist.destroy_process_group()
    return {"memory": memory, "times": times, "longest": longest, "max_rss": rss}


def _formula(method: str, cp: int, seq: int) -> float:
    from lightning_parallel.planner.context import sent_bytes
    from lightning_parallel.planner.shapes import AttentionShape

    heads, width = MODEL["n_head"], MODEL["d_model"]
    attention = AttentionShape(seq, heads, heads, width // heads, 4)
    return MODEL["n_layer"] * sum(sent_bytes(attention, method, cp, 1, 1))


def measure(seq: int, steps: int, rounds: int, budget_mib: float, search_from: int, search_to: int,
            sizes: tuple[int, ...] = SIZES, timeout: float = 900) -> list[dict]:
    """One row per (cp, method): saved bytes per rank, median step, bytes sent, longest sequence under the budget.

    Args:
        seq: tokens of the sample the memory, time and bytes are measured on.
        steps: timed steps per method per round (after a warm-up and a memory step).
        rounds: launches per context size (in turns: cp1, cp2, cp4, cp1, ...); the search runs in the first.
        budget_mib: the per-rank budget of saved activations for the longest-sequence search.
        search_from: the search's first sequence length. search_to: its longest.
        sizes: context sizes.
        timeout: seconds per launch.
    """
    from lightning_parallel.testing import run_processes

    launches: dict[int, list[list[dict]]] = {cp: [] for cp in sizes}
    search = {"budget": budget_mib * 2**20, "start": search_from, "stop": search_to}
    for round_ in range(rounds):
        for cp in sizes:
            started = time.perf_counter()
            per_rank = run_processes(_rank, cp, seq, steps, search if round_ == 0 else None, timeout=timeout)
            launches[cp].append(per_rank)
            print(f"[context_parallel] round {round_ + 1}/{rounds} cp{cp}: {time.perf_counter() - started:.0f} s",
                  flush=True)
    rows = []
    for cp in sizes:
        first = launches[cp][0]
        for method in first[0]["memory"]:
            saved = [r["memory"][method]["saved"] for r in first]
            sent = [r["memory"][method]["sent"] for r in first]
            step_times = [t for per_rank in launches[cp] for t in per_rank[0]["times"][method]]
            longest = first[0]["longest"][method]
            rows.append({
                "cp": cp, "method": method, "seq": seq, "saved_bytes_per_rank": saved,
                "largest_saved": first[0]["memory"][method]["top"], "max_rss_per_rank": [r["max_rss"] for r in first],
                "step_s": statistics.median(step_times), "steps_s": step_times,
                "sent_bytes_per_rank": [s["p2p"] + s["all_to_all"] for s in sent],
                "formula_bytes": _formula(method, cp, seq) if cp > 1 else 0.0,
                "collective_calls": sent[0]["calls"], "longest_seq": longest["longest"],
                "longest_trains": longest["trains"], "search": longest["tried"],
                "search_hit_limit": longest["hit_search_limit"], "budget_mib": budget_mib,
            })
    base = next(r for r in rows if r["cp"] == 1)
    for r in rows:
        r["memory_ratio"] = max(r["saved_bytes_per_rank"]) / max(base["saved_bytes_per_rank"])
        r["time_ratio"] = r["step_s"] / base["step_s"]
        r["longest_ratio"] = (r["longest_seq"] or 0) / (base["longest_seq"] or 1)
    return rows


def render(rows: list[dict]) -> str:
    """A markdown table with the ratios to cp 1."""
    mib = lambda values: " / ".join(f"{v / 2**20:.2f}" for v in values)  # noqa: E731
    lines = ["| cp | method | saved MiB/rank | vs cp1 | step s | vs cp1 | sent MiB/step/rank (counted) | formula MiB | "
             "longest seq under budget | vs cp1 | peak RSS MiB/rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        longest = f"{r['longest_seq']}" + ("+" if r["search_hit_limit"] else "") + ("" if r["longest_trains"] else " ✗")
        lines.append(
            f"| {r['cp']} | {r['method']} | {mib(r['saved_bytes_per_rank'])} | {r['memory_ratio']:.3f} | "
            f"{r['step_s']:.3f} | {r['time_ratio']:.2f}x | {mib(r['sent_bytes_per_rank'])} | "
            f"{r['formula_bytes'] / 2**20:.2f} | {longest} | {r['longest_ratio']:.0f}x | "
            f"{mib(r['max_rss_per_rank'])} |")
    return "\n".join(lines)


def verdict(rows: list[dict], target: float = 0.35) -> str:
    """Whether cp 4 saves at most ``target`` of cp 1's activations per rank, what it saves beyond ``1 / cp`` of cp 1,
    and which saved tensors dominate."""
    base = max(next(r for r in rows if r["cp"] == 1)["saved_bytes_per_rank"])
    lines = []
    for r in (r for r in rows if r["cp"] == 4):
        met = "meets" if r["memory_ratio"] <= target else "MISSES"
        excess = max(r["saved_bytes_per_rank"]) - base / r["cp"]
        top = ", ".join(f"{k}: {v / 2**20:.2f} MiB" for k, v in r["largest_saved"][:3])
        lines.append(f"cp4 {r['method']}: saved activations {r['memory_ratio']:.3f} of cp1 per rank ({met} <= "
                     f"{target}); {excess / 2**20:.2f} MiB ({excess / (base / r['cp']):.1%}) above a quarter of cp1; "
                     f"largest saved tensors (by shape) on rank 0: {top}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 1024, 1 round, 2 timed steps, smaller search")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    settings = {k: getattr(args, k) if getattr(args, k) is not None else v
                for k, v in (QUICK if args.quick else FULL).items()}
    start = time.perf_counter()
    rows = measure(**settings)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "settings": settings, "quick": args.quick, "how": HOW,
            "runtime_s": time.perf_counter() - start, "torch": torch.__version__}
    table, summary = render(rows), verdict(rows)
    (args.out / "context_parallel.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "context_parallel.md").write_text(f"{HOW}\n\n{table}\n\n{summary}\n")
    print(table)
    print(summary)
    print(f"[context_parallel] wrote {args.out}/context_parallel.json and .md in {meta['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
