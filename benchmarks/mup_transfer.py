"""Does the best learning rate at width 64 stay the best at width 512? μP against the standard parametrisation.

    python -m benchmarks.mup_transfer            # 5 learning rates x widths 64, 512 x 2 parametrisations, 150 steps
    python -m benchmarks.mup_transfer --quick    # 30 steps (a smoke run: the figures mean little)

The GPT recipe (examples/nlp/model.py, its own ``configure_optimizers``: AdamW, weight decay 0.1 on matrices, linear
warm-up then cosine decay; gradients clipped to norm 1 as conf/trainer/default.yaml does) with 2 blocks, 4 heads,
32-byte windows of the standard-library text, batch 16, trained on one process from the same seed and batches for every
point; the figure is the mean loss on 32 held-out windows at the end. (Without clipping, or at 100 steps, the loss at
width 64 was not a U in the learning rate: which lr escaped the bigram plateau first decided it.) Under μP
(``base_width=64``) width 64 is exactly the standard parametrisation, so both sweeps share that row; at width 512 μP
trains the hidden matrices at lr / 8 and multiplies the logits by 1/8. The learning rates are a factor-2 grid; the
best lr *transfers* when the best at width 512 is within one grid step of the best at width 64.
Results: ``benchmarks/results/<date>/mup_transfer.json`` and the table printed (docs/scaling.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from examples.nlp.data import ByteWindows, load_corpus
from examples.nlp.model import GPT

WIDTHS, BASE_WIDTH, SEQ, BATCH, VAL = (64, 512), 64, 32, 16, 32
LRS = (6.25e-4, 1.25e-3, 2.5e-3, 5e-3, 1e-2)
CLIP = 1.0


def _windows(steps: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` training batches (seeded draws, the same for every point) and the held-out windows."""
    train, val = load_corpus(None, max_bytes=2_000_000, val_every=10)
    train_w, val_w = ByteWindows(train, SEQ), ByteWindows(val, SEQ)
    generator = torch.Generator().manual_seed(0)

    def stack(windows: ByteWindows, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [windows[i] for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    batches = [stack(train_w, torch.randint(len(train_w), (BATCH,), generator=generator).tolist())
               for _ in range(steps)]
    held = stack(val_w, torch.linspace(0, len(val_w) - 1, VAL).long().tolist())
    return batches, held


def _train(width: int, mup: bool, lr: float, batches: list, held: tuple, warmup: int) -> float:
    """The held-out loss after training the recipe at ``width`` with peak ``lr`` (inf when it diverged)."""
    torch.manual_seed(0)
    model = GPT(seq_len=SEQ, d_model=width, n_layer=2, n_head=4, warmup_steps=warmup, max_steps=len(batches),
                base_width=BASE_WIDTH if mup else None, optimizer=partial(torch.optim.AdamW, lr=lr,
                                                                          betas=(0.9, 0.95))).build()
    config = model.configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        value = float(F.cross_entropy(model(held[0]).flatten(0, 1), held[1].flatten()))
    return value if math.isfinite(value) else math.inf


def _best(losses: dict[float, float]) -> float:
    return min(losses, key=losses.__getitem__)


def _table(results: dict[str, dict[int, dict[float, float]]]) -> list[str]:
    lines = ["| parametrisation | width | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " | best lr |",
             "|---|---|" + "---|" * (len(LRS) + 1)]
    for name, by_width in results.items():
        for width, losses in by_width.items():
            best = _best(losses)
            cells = [f"**{losses[lr]:.3f}**" if lr == best else f"{losses[lr]:.3f}" for lr in LRS]
            lines.append(f"| {name} | {width} | " + " | ".join(cells) + f" | {best:g} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine's cores are shared)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / str(date.today()))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = 30 if args.quick else args.steps
    batches, held = _windows(steps)
    warmup = max(1, steps // 10)
    results: dict[str, dict[int, dict[float, float]]] = {"μP": {}, "standard": {}}
    started = time.perf_counter()
    for width in WIDTHS:
        for name in results:
            if width == BASE_WIDTH and name == "standard":  # the same model: μP is the standard one at base width
                results[name][width] = dict(results["μP"][width])
                continue
            results[name][width] = {lr: _train(width, name == "μP", lr, batches, held, warmup) for lr in LRS}
            print(f"{name} width {width}: " + ", ".join(f"{lr:g}: {v:.3f}" for lr, v in results[name][width].items()),
                  flush=True)
    verdicts = {}
    for name, by_width in results.items():
        first, last = (_best(by_width[w]) for w in WIDTHS)
        grid_steps = abs(round(math.log2(last / first)))
        verdicts[name] = {"best_lr": {str(w): _best(by_width[w]) for w in WIDTHS}, "grid_steps_apart": grid_steps,
                          "transfers": grid_steps <= 1}
    print("\n".join(_table(results)))
    for name, verdict in verdicts.items():
        print(f"{name}: best lr {verdict['best_lr']}, {verdict['grid_steps_apart']} grid step(s) apart -> "
              f"{'transfers' if verdict['transfers'] else 'does not transfer'}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"model": f"GPT recipe, 2 blocks, 4 heads, seq {SEQ}, batch {BATCH}", "steps": steps,
                            "clip": CLIP,
                            "warmup": warmup, "base_width": BASE_WIDTH, "lrs": LRS, "threads": args.threads,
                            "seconds": round(time.perf_counter() - started, 1)}
    saved = {name: {str(w): {str(lr): v for lr, v in losses.items()} for w, losses in by_width.items()}
             for name, by_width in results.items()}
    (args.out / "mup_transfer.json").write_text(json.dumps({"meta": meta, "losses": saved, "verdicts": verdicts},
                                                           indent=2))


if __name__ == "__main__":
    main()
