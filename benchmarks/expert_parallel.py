"""Expert parallelism on the GPT MoE recipe: three designs of an MoE layer over 1, 2 and 4 ranks, bytes and step time.

    python -m benchmarks.expert_parallel            # 1, 2, 4 processes, 3 rounds of 30 timed steps per design
    python -m benchmarks.expert_parallel --quick    # 1 round of 10 timed steps (< 3 minutes; ~20 s here)

The GPT recipe with ``model=gpt_moe``'s experts (width 64, 2 blocks of which block 1 is MoE: 8 GELU experts of
hidden 256, top-2 softmax routing, dropless, balancing loss 0.01; bytes, no dropout) trains on a global batch of
8 x 128 tokens split over the ranks (gloo, one process each through :func:`lightning_parallel.testing.run_processes`)
in a raw loop: forward, backward, gradient synchronisation, AdamW. Three designs of the MoE layer, built in the same
processes from the same initial weights and taking turns step by step on the same batches:

* ``all_to_all`` -- the suite's expert parallelism with ``expert_parallel_size`` = world
  (:class:`~lightning_parallel.parallel.experts.ExpertParallel`): each rank holds ``E / ep`` experts; token copies
  travel to their expert's rank by all-to-all with variable splits and back; expert gradients need no reduction
  (the expert-data group is one rank), only the divide by the data ranks.
* ``replicated`` -- ``expert_parallel_size=1`` under data parallelism: every rank holds every expert and runs its
  own tokens; expert gradients are all-reduced over the data ranks with the dense ones.
* ``all_reduce_outputs`` -- the "replicated tokens, all-reduce outputs" design transformers uses for its own
  expert parallelism (:func:`replicated_tokens_forward`, here only): each rank holds ``E / ep`` experts, every
  token goes to every rank, each rank computes its experts' share of every token, the outputs are all-reduced.
  transformers runs it on a group whose ranks already hold the same tokens; ranks that hold different tokens (data
  parallel outside the MoE layer) first all-gather them, and keep their own rows of the reduced output.

All three run the experts with the recipe's loop over experts (no grouped GEMM kernel), and synchronise the dense
gradients with one flat all-reduce (``/ world``), as DDP would. Measured:

* Bytes sent per step per rank, counted where ``dist.all_to_all_single``, ``all_reduce``, ``all_gather_single`` and
  ``reduce_scatter_single`` are called (``HOW`` gives what each counts), split into token traffic (the MoE layer's
  forward and backward), gradient synchronisation and the balancing loss's statistics; ``formula`` is the planner's
  (:func:`lightning_parallel.planner.experts.sent_bytes`, a uniform router) for the all-to-all design.
* Expert parameter bytes per rank; the median step of the slowest rank; the largest loss difference to one process
  over the steps (every design trains the same model on the same global batch: float noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

MODEL = {"vocab_size": 256, "seq_len": 128, "d_model": 64, "n_layer": 2, "n_head": 4, "dropout": 0.0}
MOE = {"every": 2, "num_experts": 8, "top_k": 2, "router": "softmax", "capacity_factor": None,
       "aux_loss_weight": 0.01}  # conf/model/gpt_moe.yaml
BATCH = 8
DESIGNS = ("all_to_all", "replicated", "all_reduce_outputs")
WORLDS = (1, 2, 4)
FULL = {"steps": 30, "rounds": 3}
QUICK = {"steps": 10, "rounds": 1}
HOW = ("How: GPT + gpt_moe experts (d_model 64, 2 blocks, block 1 MoE: 8 experts of hidden 256, top-2, dropless, aux "
       "0.01), global batch 8 x 128 tokens over the ranks (gloo, one process each, this machine's cores); raw loop "
       "forward + backward + gradient sync + AdamW; designs alternate step by step in one launch on the same batches. "
       "Bytes leaving the rank per step, counted at the collectives (all-to-all: rows for others; all-reduce: "
       "2(n-1)/n B; all-gather: (n-1) x input; reduce-scatter: (n-1)/n x input), mean over timed steps, most loaded "
       "rank; 'formula': the planner's uniform-router all-to-all bytes. Time: median step of the slowest rank.")


class Sent:
    """Bytes this rank sends through the wrapped collectives, by phase (set by the loop) and collective."""

    def __init__(self) -> None:
        self.phase = "other"
        self.bytes: dict[str, float] = {}

    def add(self, nbytes: float) -> None:
        self.bytes[self.phase] = self.bytes.get(self.phase, 0.0) + nbytes

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_to_all_bytes(n: int, rank: int, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, **_: Any) -> float:
    if input_split_sizes:  # rows of variable count: those for the other ranks leave
        return _nbytes(input) // max(1, input.shape[0]) * (sum(input_split_sizes) - input_split_sizes[rank])
    return _nbytes(input) * (n - 1) / n


SENT_BY = {  # bytes leaving a rank of ``n``: (n, rank, the collective's arguments) -> bytes
    "all_to_all_single": _all_to_all_bytes,
    "all_reduce": lambda n, rank, tensor, *args, **kwargs: 2 * (n - 1) / n * _nbytes(tensor),  # ring
    "all_gather_single": lambda n, rank, output, input, *args, **kwargs: (n - 1) * _nbytes(input),
    "reduce_scatter_single": lambda n, rank, output, input, *args, **kwargs: (n - 1) / n * _nbytes(input),
}


@contextmanager
def counted(sent: Sent) -> Iterator[Sent]:
    """Wrap the collectives of :data:`SENT_BY` (looked up on ``torch.distributed`` at call time by the suite's
    dispatch and by this file) so that ``sent`` counts the bytes leaving this rank."""
    saved = {name: getattr(dist, name) for name in SENT_BY}

    def wrap(name: str) -> Any:
        def call(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            sent.add(SENT_BY[name](dist.get_world_size(group), dist.get_rank(group), *args, **kwargs))
            return saved[name](*args, group=group, **kwargs)
        return call

    for name in SENT_BY:
        setattr(dist, name, wrap(name))
    try:
        yield sent
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _GatherRows(torch.autograd.Function):
    """All-gather rows over the group; backward: reduce-scatter of the rows' gradients (each rank gets its own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class _ReduceOwnRows(torch.autograd.Function):
    """All-reduce partial outputs of every rank's rows and keep this rank's; backward: all-gather the kept rows'
    gradients (every rank's partial output fed every rank's rows)."""

    @staticmethod
    def forward(ctx, partial_out: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        full = partial_out.clone()
        dist.all_reduce(full, group=group)
        rows = full.shape[0] // dist.get_world_size(group)
        rank = dist.get_rank(group)
        return full[rank * rows:(rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def replicated_tokens_forward(block: Any, x: torch.Tensor, group: Any, first: int) -> torch.Tensor:
    """An MoE block's forward in the "replicated tokens, all-reduce outputs" design (module docstring).

    Args:
        block: the recipe's ``MoEFeedForward``, its experts sliced to this rank's ``[first, first + E/ep)``.
        x: ``[..., d]`` this rank's tokens.
        group: the expert group (every rank: ``ep`` = world).
        first: the first expert this rank holds.
    """
    flat = x.reshape(-1, x.shape[-1])
    ids, weights, probs = block.route(flat)  # on this rank's tokens, as the other designs route
    counts = torch.bincount(ids.flatten(), minlength=block.num_experts)
    block._record(counts, probs, flat.shape[0], counts.new_zeros(()))  # dropless: the balancing loss's statistics
    every = _GatherRows.apply(flat, group)  # every token to every rank
    every_weights = _GatherRows.apply(weights, group)
    every_ids = ids.new_empty((dist.get_world_size(group) * ids.shape[0], ids.shape[1]))
    dist.all_gather_single(every_ids, ids.contiguous(), group=group)
    local = every_ids.flatten() - first
    held = block.experts.w_up.shape[0]
    copies = torch.nonzero((local >= 0) & (local < held)).squeeze(1)
    copies = copies[torch.argsort(local[copies], stable=True)]  # sorted by local expert
    token = copies // block.top_k
    rows = block.experts.expert_mlp(every[token], torch.bincount(local[copies], minlength=held),
                                    block.experts.w_up, block.experts.w_down)
    scaled = rows * every_weights.flatten()[copies, None]
    partial_out = torch.zeros_like(every).index_add(0, token, scaled)
    return block.drop(_ReduceOwnRows.apply(partial_out, group)).reshape(x.shape)


def _build(design: str, world: int) -> tuple:
    """The recipe in ``design`` (same seed, same initial weights): ``(module, optimizer, expert parameter names)``."""
    from examples.nlp.model import GPT
    from examples.nlp.moe import moe_blocks
    from lightning_parallel.parallel.experts import ExpertParallel, expert_block

    torch.manual_seed(0)
    module = GPT(**MODEL, moe=MOE).build()
    group = dist.group.WORLD
    for block in moe_blocks(module):
        if design == "all_to_all":
            block.experts = ExpertParallel(block.experts, group)  # plain slices, the recipe's loop over experts
        elif design == "all_reduce_outputs":
            first, end = expert_block(block.num_experts, world, dist.get_rank())
            for name in ("w_up", "w_down"):
                weight = getattr(block.experts, name)
                setattr(block.experts, name, torch.nn.Parameter(weight.detach()[first:end].clone()))
            block.forward = partial(replicated_tokens_forward, block, group=group, first=first)
    experts = {name for name, _ in module.named_parameters() if ".experts." in name}
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3), experts


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch (the same for every design and world size)."""
    tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["seq_len"] + 1),
                           generator=torch.Generator().manual_seed(step))
    share = tokens[rank * BATCH // world:(rank + 1) * BATCH // world]
    return share[:, :-1], share[:, 1:]


def _sync(module: torch.nn.Module, design: str, experts: set[str], world: int, sent: Sent) -> None:
    """Gradient synchronisation: dense gradients averaged by one all-reduce; expert gradients by design."""
    from lightning_parallel.parallel.experts import reduce_expert_gradients

    named = [(n, p) for n, p in module.named_parameters() if p.grad is not None]
    groups = {"dense grads": [p.grad for n, p in named if n not in experts],
              "expert grads": [p.grad for n, p in named if n in experts]}
    for phase, grads in groups.items():
        if phase == "expert grads" and design != "replicated":
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        with sent.during(phase):
            dist.all_reduce(flat)
        flat /= world
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
    if design == "all_to_all":
        reduce_expert_gradients(module, None, world)  # the expert-data group is one rank: the divide alone
    elif design == "all_reduce_outputs":
        for g in groups["expert grads"]:
            g /= world  # every rank's tokens reached the experts: the sum of all ranks' losses, as all_to_all's


def _step(run: tuple, design: str, step: int, rank: int, world: int) -> dict[str, Any]:
    """One training step of ``design``: the slowest rank's seconds, the global loss, the bytes sent by phase."""
    from examples.nlp.moe import model_balancing_loss

    module, optimizer, experts = run
    x, y = _batch(step, rank, world)
    optimizer.zero_grad(set_to_none=True)
    sent = Sent()
    mean = lambda t: _mean(t, sent)  # noqa: E731
    dist.barrier()
    start = time.perf_counter()
    with counted(sent):
        with sent.during("tokens forward"):
            loss = module.pipeline_loss(module(x), y)
            aux, _ = model_balancing_loss(module, mean=mean)
        with sent.during("tokens backward"):
            (loss + aux).backward()
        _sync(module, design, experts, world, sent)
    optimizer.step()
    elapsed, mean_loss = torch.tensor([time.perf_counter() - start]), loss.detach().reshape(1) / world
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    dist.all_reduce(mean_loss)
    return {"seconds": float(elapsed), "loss": float(mean_loss) + float(aux.detach()), "sent": sent.bytes}


def _mean(tensor: torch.Tensor, sent: Sent) -> torch.Tensor:
    with sent.during("balancing loss"):
        dist.all_reduce(tensor)
    return tensor / dist.get_world_size()


def _rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    runs = {design: _build(design, world) for design in DESIGNS}
    records: dict[str, list[dict]] = {design: [] for design in DESIGNS}
    for step in range(steps + 1):  # a warm-up step, then the timed ones
        for design, run in runs.items():
            records[design].append(_step(run, design, step, rank, world))
    expert_bytes = {d: sum(_nbytes(p) for n, p in run[0].named_parameters() if n in run[2]) for d, run in runs.items()}
    dist.destroy_process_group()
    return {"records": records, "expert_bytes": expert_bytes}


def _formula(world: int) -> float:
    from lightning_parallel.planner.experts import sent_bytes
    from lightning_parallel.planner.shapes import ExpertShape

    width = MODEL["d_model"]
    experts = ExpertShape(MOE["num_experts"], MOE["top_k"], width, 4 * width, MODEL["seq_len"], 2 * width * 4 * width)
    return sum(sent_bytes(experts, world, BATCH // world * MODEL["seq_len"]))  # one MoE layer


def _phase_bytes(rank: dict, design: str) -> dict[str, float]:
    """A rank's mean bytes per timed step by phase."""
    timed = rank["records"][design][1:]
    phases = {p for rec in timed for p in rec["sent"]}
    return {p: statistics.mean(rec["sent"].get(p, 0.0) for rec in timed) for p in phases}


def _row(world: int, design: str, launches: list[list[dict]]) -> dict[str, Any]:
    """One table row from every launch's per-rank records (the warm-up step dropped); bytes of the most loaded
    rank of the first launch (the routing, hence the bytes, is the same in every launch)."""
    timed = [r for per_rank in launches for r in per_rank[0]["records"][design][1:]]
    ranks = [_phase_bytes(rank, design) for rank in launches[0]]
    most = lambda phases: max(sum(r.get(p, 0.0) for p in phases) for r in ranks)  # noqa: E731
    return {"world": world, "design": design, "expert_param_bytes": launches[0][0]["expert_bytes"][design],
            "token_bytes": most(("tokens forward", "tokens backward")),
            "grad_bytes": most(("dense grads", "expert grads")), "total_bytes": most({p for r in ranks for p in r}),
            "by_phase": {p: most((p,)) for p in sorted({p for r in ranks for p in r})},
            "formula_token_bytes": _formula(world) if design == "all_to_all" else None,
            "step_s": statistics.median(r["seconds"] for r in timed), "steps_s": [r["seconds"] for r in timed],
            "losses": [r["loss"] for r in launches[0][0]["records"][design]]}


def measure(steps: int, rounds: int, worlds: tuple[int, ...] = WORLDS, timeout: float = 900) -> list[dict]:
    """One row per (world, design): bytes per step by kind, expert bytes per rank, median step, loss agreement.

    Args:
        steps: timed steps per design per launch (after one warm-up step).
        rounds: launches per world size (in turns: 1, 2, 4, 1, ...).
        worlds: process counts.
        timeout: seconds per launch.
    """
    from lightning_parallel.testing import run_processes

    launches: dict[int, list[list[dict]]] = {w: [] for w in worlds}
    for round_ in range(rounds):
        for world in worlds:
            started = time.perf_counter()
            launches[world].append(run_processes(_rank, world, steps, timeout=timeout))
            print(f"[expert_parallel] round {round_ + 1}/{rounds} world {world}: "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    rows = [_row(w, d, launches[w]) for w in worlds for d in DESIGNS]
    reference = next((r for r in rows if r["world"] == 1 and r["design"] == "replicated"), rows[0])["losses"]
    for r in rows:
        same = next(x for x in rows if x["world"] == r["world"] and x["design"] == "replicated")
        r["bytes_vs_replicated"] = r["total_bytes"] / same["total_bytes"] if same["total_bytes"] else None
        r["time_vs_replicated"] = r["step_s"] / same["step_s"]
        r["expert_bytes_vs_replicated"] = r["expert_param_bytes"] / same["expert_param_bytes"]
        r["max_loss_diff_vs_one_process"] = max(abs(a - b) for a, b in zip(r["losses"], reference))
    return rows


def render(rows: list[dict]) -> str:
    """A markdown table with ratios to the replicated design of the same world size."""
    kib = lambda v: f"{v / 1024:.1f}"  # noqa: E731
    ratio = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = ["| ranks | design | expert params KiB/rank | vs repl. | token KiB/step/rank | formula KiB | grad sync "
             "KiB/step/rank | total KiB/step/rank | vs repl. | step ms | vs repl. | max abs loss diff vs 1 process |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        formula = "-" if r["formula_token_bytes"] is None else kib(r["formula_token_bytes"])
        lines.append(f"| {r['world']} | {r['design']} | {kib(r['expert_param_bytes'])} | "
                     f"{r['expert_bytes_vs_replicated']:.2f}x | {kib(r['token_bytes'])} | {formula} | "
                     f"{kib(r['grad_bytes'])} | {kib(r['total_bytes'])} | {ratio(r['bytes_vs_replicated'])} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['time_vs_replicated']:.2f}x | "
                     f"{r['max_loss_diff_vs_one_process']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 10 timed steps")
    parser.add_argument("--steps", type=int, default=None, help=f"timed steps per design (default {FULL['steps']})")
    parser.add_argument("--rounds", type=int, default=None, help=f"launches per world (default {FULL['rounds']})")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    settings = {k: getattr(args, k) if getattr(args, k) is not None else v
                for k, v in (QUICK if args.quick else FULL).items()}
    start = time.perf_counter()
    rows = measure(**settings)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "moe": MOE, "batch": BATCH, "settings": settings, "quick": args.quick, "how": HOW,
            "runtime_s": time.perf_counter() - start, "torch": torch.__version__}
    table = render(rows)
    (args.out / "expert_parallel.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "expert_parallel.md").write_text(f"{HOW}\n\n{table}\n")
    print(table)
    print(f"[expert_parallel] wrote {args.out}/expert_parallel.json and .md in {meta['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
