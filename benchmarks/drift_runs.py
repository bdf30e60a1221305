"""The drift study's runs (``benchmarks/drift_study.py``): its models, layouts and data, one layout's run in its own
processes, and the floor run of a layout's arithmetic on one process.

Also the rank functions of ``tests/distributed/test_drift_study.py`` (its 200-step and short versions).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from benchmarks.hf_coverage.arithmetic import GPT, HF, MICROBATCHES, Arithmetic, Objective, train_in_order

STEPS, GLOBAL_BATCH, SEQ = 500, 8, 16
RECORD = (1, 10, 50, 100, 200, 300, 400, 500)  # steps after which the whole model's parameters are kept
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8}  # weight decay 0.1 on matrices: the recipes' groups
HF_VOCAB = 128


@dataclass(frozen=True)
class Layout:
    """One layout of the study: the strategy's sizes, its processes, its data-parallel ranks, and the arithmetic
    whose one-process run is its floor (``floor_kind``: ``"same"``, or ``"data-shard proxy"`` where the loop does not
    reproduce the layout's order)."""

    label: str
    sizes: dict[str, Any]
    world: int
    data_parallel: int
    arithmetic: Arithmetic
    floor_kind: str = "same"


LAYOUTS: dict[str, Layout] = {
    "single": Layout("one process", {}, 1, 1, Arithmetic()),
    "data2_zero3": Layout("data 2 ZeRO-3", {"data_parallel_size": 2, "zero_stage": 3}, 2, 2,
                          Arithmetic(data_shards=2)),
    "pipeline2": Layout("pipeline 2", {"pipeline_parallel_size": 2, "microbatches": MICROBATCHES}, 2, 1,
                        Arithmetic(microbatches=MICROBATCHES)),
    "tensor2": Layout("tensor 2", {"tensor_parallel_size": 2}, 2, 1, Arithmetic(tensor=True)),
    "context2": Layout("context 2 (ring)", {"context_parallel_size": 2}, 2, 1, Arithmetic(data_shards=2),
                       "data-shard proxy"),
    "expert2": Layout("data 2 x expert 2", {"data_parallel_size": 2, "expert_parallel_size": 2}, 2, 2,
                      Arithmetic(data_shards=2)),
}


@dataclass(frozen=True)
class Model:
    """One model of the study: how to build it (seeded), its objective, its samples, the layouts it runs."""

    build: Callable[[], pl.LightningModule]
    objective: Objective
    samples: Callable[[int], list]
    layouts: tuple[str, ...] = field(default=("data2_zero3", "pipeline2", "tensor2", "context2"))


def _windows(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` byte windows of the standard library's text: inputs, next-byte targets, valid lengths (seeded)."""
    from examples.nlp.data import ByteWindows, load_corpus

    train, _ = load_corpus(None, max_bytes=(count + 1) * SEQ * 2, val_every=10)
    windows = ByteWindows(train, SEQ)
    inputs = torch.stack([windows[i][0] for i in range(count)])
    targets = torch.stack([windows[i][1] for i in range(count)])
    valid = torch.randint(2, SEQ + 1, (count,), generator=torch.Generator().manual_seed(7))
    return inputs, targets, valid


def gpt_samples(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded byte windows: after a seeded valid length the inputs are 0 and the targets -100."""
    inputs, targets, valid = _windows(steps * GLOBAL_BATCH)
    pad = torch.arange(SEQ)[None, :] >= valid[:, None]
    inputs, targets = inputs.masked_fill(pad, 0), targets.masked_fill(pad, -100)
    return list(zip(inputs, targets))


def hf_samples(steps: int) -> list[dict[str, torch.Tensor]]:
    """The same windows for a Hugging Face model: bytes folded into ids 3..127, right-padded (id 0, mask 0, label
    -100), the first token of every third row a masked prompt."""
    inputs, _, valid = _windows(steps * GLOBAL_BATCH)
    mask = (torch.arange(SEQ)[None, :] < valid[:, None]).long()
    ids = (inputs % (HF_VOCAB - 3) + 3).masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[::3, 0] = -100
    return [{"input_ids": i, "attention_mask": m, "labels": lab} for i, m, lab in zip(ids, mask, labels)]


def _gpt() -> pl.LightningModule:
    from examples.nlp.model import GPT as Recipe

    return Recipe(seq_len=SEQ, d_model=32, n_layer=2, n_head=4, optimizer=partial(torch.optim.AdamW, **ADAMW),
                  weight_decay=0.1)


def _family(model_type: str) -> pl.LightningModule:
    from benchmarks.hf_coverage.cells import TinyFamily

    return TinyFamily(model_type, "adamw")  # the matrix's AdamW mode: lr 3e-4, betas (0.9, 0.95), decay 0.1


MODELS: dict[str, Model] = {
    "gpt": Model(_gpt, GPT, gpt_samples),
    "llama": Model(partial(_family, "llama"), HF, hf_samples),
    "mixtral": Model(partial(_family, "mixtral"), HF, hf_samples, ("data2_zero3", "expert2", "pipeline2")),
}


def recorded_steps(steps: int) -> list[int]:
    """The steps of :data:`RECORD` a run of ``steps`` reaches, and its last."""
    return sorted({s for s in RECORD if s <= steps} | {steps})


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def fit_rank(rank: int, world_size: int, model: str, layout: str, steps: int) -> dict[str, Any]:
    """Rank function: ``model`` trained ``steps`` steps under ``layout``; rank 0 returns ``{"losses",
    "parameters": {step: {name: tensor}}}`` (other ranks ``None``)."""
    from benchmarks.hf_coverage.cells import StepParameters
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.compare import StepRecorder
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData

    _quiet()
    spec, chosen = MODELS[model], LAYOUTS[layout]
    pl.seed_everything(0, verbose=False)
    module = spec.build()
    strategy = HybridParallelStrategy(**chosen.sizes, timeout=120) if chosen.world > 1 else "auto"
    recorder, taken = StepRecorder(), StepParameters(recorded_steps(steps))
    trainer = quiet_trainer(world_size, strategy, steps, [recorder, taken], limit_val_batches=0,
                            num_sanity_val_steps=0)
    trainer.fit(module, datamodule=FixedOrderData(spec.samples(steps), GLOBAL_BATCH // chosen.data_parallel))
    if trainer.global_rank != 0:
        return None
    return {"losses": recorder.losses, "parameters": dict(taken.parameters)}


def _launched_rank(rank: int, world_size: int, model: str, layout: str, steps: int) -> dict[str, Any]:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the strategy's start-up table
    return fit_rank(rank, world_size, model, layout, steps)


def layout_run(model: str, layout: str, steps: int, timeout: float = 3600) -> dict[str, Any]:
    """``model`` under ``layout`` in its own processes (:func:`fit_rank`), rank 0's record."""
    from lightning_parallel.testing import run_processes

    return run_processes(_launched_rank, LAYOUTS[layout].world, model, layout, steps, timeout=timeout)[0]


def floor_run(model: str, layout: str, steps: int, objective: Optional[Objective] = None) -> dict[str, Any]:
    """``model`` trained on one process in ``layout``'s arithmetic on the same batches: ``{"losses", "parameters":
    {step: {name: tensor}}}`` (the loss of each step as the layout computes it: the mean over its data shards).

    Args:
        model, layout, steps: as :func:`layout_run`.
        objective: another objective than the model's (a negative control's wrong loss).
    """
    _quiet()
    spec = MODELS[model]
    pl.seed_everything(0, verbose=False)
    module = spec.build().build()
    samples = spec.samples(steps)
    collate = torch.utils.data.default_collate
    batches = ((collate(samples[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH]), GLOBAL_BATCH) for i in range(steps))
    wanted = set(recorded_steps(steps))
    result = train_in_order(module, batches, LAYOUTS[layout].arithmetic, objective or spec.objective,
                            lambda s: s in wanted)
    return {"losses": result["losses"], "parameters": result["step_parameters"]}
