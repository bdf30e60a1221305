"""The suite's per-step callbacks add no collective to a steady-state step, and take Lightning's away (issue 28).

``lp-train`` always runs :class:`GracefulStop` and, by default, :class:`NonFiniteGuard`. Counted with the
benchmarks' ``CommCounter`` (torch.distributed calls and DTensor's functional collectives) over steps 5-10 of the
same fit with and without them: the same under tensor 2 with clipping (the guard reads the clipping's global norm)
and under Lightning's DDP (every rank holds the whole averaged gradient: a local check) but for Lightning's
per-step broadcast of its SIGTERM flag, which the bare Trainer runs and the suite drops (its signal handlers hold
SIGTERM), and the stop agreement runs once per ``agree_every_s`` seconds after 3 probe steps. The control, an
agreement every step (the old behaviour), adds one all-reduce per step and is counted, so the counter sees what it
is meant to.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_parallel.callbacks import NonFiniteGuard
from lightning_parallel.callbacks.graceful_stop import GracefulStop
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

FIRST, LAST, STEPS = 4, 9, 10  # batch indices of the counted window (steps 5-10)


class CountWindow(pl.Callback):
    """Counts every collective from the start of batch ``FIRST`` to the end of batch ``LAST``."""

    def __init__(self) -> None:
        from benchmarks.comm import CommCounter

        self.counter = CommCounter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FIRST:
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == LAST:
            self.counter.__exit__(None, None, None)


def _count(strategy, world_size: int, callbacks: list, clip) -> dict[str, int]:
    pl.seed_everything(0)
    window = CountWindow()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, gradient_clip_val=clip, callbacks=[*callbacks, window])
    data_parallel = world_size if strategy == "ddp" else 1
    trainer.fit(ResidualMLP(width=16, depth=2), datamodule=FixedOrderData(regression_dataset(256, 16),
                                                                          16 // data_parallel))
    return dict(window.counter.counts)


def _layouts(rank: int, world_size: int, folder: str) -> dict[str, dict[str, int]]:
    suite = lambda every: [NonFiniteGuard(), GracefulStop(folder, agree_every_s=every)]  # noqa: E731
    out = {}
    for name, strategy, clip in (("tp2, clipping", lambda: HybridParallelStrategy(tensor_parallel_size=2), 0.5),
                                 ("ddp", lambda: "ddp", None)):
        out[name] = {"raw": _count(strategy(), world_size, [], clip),
                     "suite": _count(strategy(), world_size, suite(3600.0), clip),
                     "every step": _count(strategy(), world_size, suite(0.0), clip)}
    return out


def test_the_suites_callbacks_add_no_collective_to_a_steady_step(tmp_path):
    counts = run_processes(_layouts, 2, str(tmp_path), timeout=600)[0]
    steps = LAST - FIRST + 1
    for name, runs in counts.items():
        print(name, runs)
        # Lightning broadcasts its SIGTERM flag before every step; with the suite's handlers holding SIGTERM that
        # flag is never set and GracefulStop's agreement stands in: one collective per step fewer than a bare Trainer.
        # It runs before a step's on_train_batch_start: the window holds those of its steps but the first.
        assert runs["raw"].get("broadcast", 0) == steps - 1, (name, runs)
        assert runs["suite"] == {op: n for op, n in runs["raw"].items() if op != "broadcast"}, (name, runs)
        extra = runs["every step"].get("all_reduce", 0) - runs["raw"].get("all_reduce", 0)
        assert extra == steps, (name, runs)  # the control: one agreement per step is seen
