"""Real 4-rank runs of the tiny GPT counting one training step's collectives and saved activations, and the same
layouts' simulated steps (``tests/distributed/planner/test_simulation_step.py``)."""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

import lightning.pytorch as pl

from tests.distributed.planner.simulation_runs import LAYOUTS, WORLD, gpt

BATCH, SEQ = 8, 16  # the global batch of simulation_runs.measure_layouts
# Step-only layouts: activation checkpointing (what it keeps is counted apart from autograd's saved tensors).
# Not here as a whole step: sequence parallelism, whose real step reduces more than the simulated one
# (docs/simulation.md); under pipelining its sends and receives are compared.
EXTRA = {"dp4 zero3 full checkpointing": ({"data_parallel_size": 4, "zero_stage": 3,
                                          "activation_checkpointing": "full"}, {}),
         "dp2 x tp2 zero3 selective checkpointing": ({"data_parallel_size": 2, "tensor_parallel_size": 2,
                                                      "zero_stage": 3, "activation_checkpointing": "selective"}, {}),
         # GPipe holds every micro-batch's activations at once: what a real step saves is the simulated peak.
         "dp2 x pp2 gpipe": ({"data_parallel_size": 2, "pipeline_parallel_size": 2, "schedule": "gpipe",
                              "microbatches": 4}, {}),
         # Sequence parallelism under pipelining: the stages exchange each tensor rank's slice of the sequence.
         "pp2 x tp2 sequence parallel": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                                          "data_parallel_size": 1, "sequence_parallel": True, "microbatches": 2}, {})}
STEP_CASES = {**LAYOUTS, **EXTRA}
# The layouts whose step the simulation runs (MoE routing needs values, which meta has none of): whole steps, and
# pipelined ones (their sends and receives; the second step is counted, the first also infers shapes).
STEP_LAYOUTS = [name for name, (options, model) in STEP_CASES.items()
                if options.get("pipeline_parallel_size", 1) == 1 and "moe" not in model]
PIPELINED_LAYOUTS = [name for name, (options, model) in STEP_CASES.items()
                     if options.get("pipeline_parallel_size", 1) > 1 and "moe" not in model]


class CountStep(pl.Callback):
    """Counts the first training step's collectives (from its batch's start to its end, the optimizer step
    included) with lp-simulate's own counter, and the bytes autograd saves in its forward.

    The strategy's ``reduce`` (the model's loss mean and logged metrics) is left out of the count, as the simulation
    leaves it out (``planner/simulation/step.py``).
    """

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.collectives: list[dict[str, Any]] = []
        self.activation_bytes = 0
        self._stack: ExitStack | None = None
        self._saved: Any = None
        self._forward: Any = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        # One wrapper for the whole fit: Lightning compares a logged value's reduction between steps.
        strategy, reduce = trainer.strategy, trainer.strategy.reduce

        def unseen_reduce(*args: Any, **kwargs: Any) -> Any:
            counter = getattr(self, "counter", None)
            if counter is not None:
                counter.paused = True
            try:
                return reduce(*args, **kwargs)
            finally:
                if counter is not None:
                    counter.paused = False

        strategy.reduce = unseen_reduce

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        del trainer.strategy.reduce  # the strategy's own method again

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx != self.step:
            return
        from lightning_parallel.planner.simulation.collectives import CountCollectives, group_axes
        from lightning_parallel.planner.simulation.step import _SavedTensors

        strategy = trainer.strategy
        self.counter = CountCollectives(group_axes(strategy.meshes))
        selective = strategy.options.activation_checkpointing == "selective"
        self._saved = _SavedTensors(module, selective=selective)
        self._stack = ExitStack()
        self._stack.enter_context(self.counter)
        self._forward = self._saved.counting()
        self._forward.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, module: pl.LightningModule, loss: Any) -> None:
        if self._forward is not None and self._stack is not None:
            self._forward.__exit__(None, None, None)
            self._forward = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self._stack is None:
            return
        if self._forward is not None:  # a pipeline schedule runs its backward inside training_step
            self._forward.__exit__(None, None, None)
            self._forward = None
        self._stack.close()
        self._stack = None
        self.collectives = self.counter.summary()
        self.activation_bytes = self._saved.total()


def measure_steps(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Fit one step of every named layout; per layout, this rank's counted collectives and saved bytes."""
    from lightning_parallel import _compat
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData
    from tests.distributed.parity_runs import text_dataset

    out = {}
    for name in names:
        options, model_overrides = STEP_CASES[name]
        # DTensor's cached placements would hand this layout an earlier layout's mesh of equal shape (and its
        # process group): one process runs every layout here.
        _compat.clear_dtensor_caches()
        pl.seed_everything(0)
        pipelined = options.get("pipeline_parallel_size", 1) > 1
        counter = CountStep(step=1 if pipelined else 0)
        strategy = HybridParallelStrategy(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options})
        data_parallel = options.get("data_parallel_size", 1)
        trainer = quiet_trainer(world_size, strategy, 2 if pipelined else 1, [counter], limit_val_batches=0)
        data = FixedOrderData(text_dataset(32, SEQ), batch_size=BATCH // data_parallel)
        trainer.fit(gpt(**model_overrides), datamodule=data)
        out[name] = {"collectives": counter.collectives, "activation_bytes": counter.activation_bytes}
    return out


def simulated_step(name: str) -> Any:
    """The simulation of layout ``name`` on :data:`WORLD` ranks with one step of the same batch."""
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner import simulate
    from lightning_parallel.planner.simulation.step import token_batch

    options, model_overrides = STEP_CASES[name]
    full = {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options}
    per_rank = BATCH // options.get("data_parallel_size", 1)
    return simulate(partial(gpt, **model_overrides), ParallelOptions(**full), WORLD,
                    batch=partial(token_batch, per_rank, SEQ))

