"""fixed_global_batch: 1 and 2 DDP processes run the same optimisation (losses within 1e-5).

The accumulation of each run is chosen by :func:`lightning_parallel.scaling.rescale_for_layout`
from the strategy's layout, as ``train.py`` does; the losses are compared per optimizer
step (the mean over its micro-batches), since the two runs split a step differently.
"""

from functools import partial

import pytest
import torch

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.scaling import Reference, rescale_for_layout
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_cases, tiny_gpt

pytestmark = pytest.mark.slow

REFERENCE = Reference(global_batch_size=16, lr=3e-3, warmup_steps=3, devices=1)
MICRO_BATCH = 4
STEPS = 10


def _case(world_size: int, accumulate: int, lr: float, warmup_steps: int) -> dict:
    """The GPT recipe (AdamW, warm-up) on real text, as the rank function's keyword arguments."""
    model = partial(tiny_gpt, optimizer=partial(torch.optim.AdamW, lr=lr), warmup_steps=warmup_steps, max_steps=STEPS)
    return dict(strategy="ddp" if world_size > 1 else "auto", global_batch=MICRO_BATCH * world_size,
                data_parallel=world_size, steps=STEPS, trainer_kwargs={"accumulate_grad_batches": accumulate},
                model_factory=model, dataset="text")  # fmt: skip


def _fixed_case(world_size: int) -> dict:
    layout = ParallelLayout.resolve(world_size)  # DDP: every rank is a data-parallel replica
    eff = rescale_for_layout("fixed_global_batch", REFERENCE, layout, micro_batch_size=MICRO_BATCH)
    assert eff.global_batch_size == REFERENCE.global_batch_size
    return _case(world_size, eff.accumulate_grad_batches, eff.lr, eff.warmup_steps)


def per_step(losses: list[float], accumulate: int) -> list[float]:
    """Mean loss of each optimizer step from the loss of each micro-batch."""
    return [sum(losses[i : i + accumulate]) / accumulate for i in range(0, len(losses), accumulate)]


def test_fixed_global_batch_gives_the_same_losses_on_one_and_two_devices():
    one = _fixed_case(1)
    # The negative control rides in the same launch: the 1-device run without rescaling
    # (accumulation of the 2-device run, so half the global batch) must differ.
    unscaled = _case(
        1, _fixed_case(2)["trainer_kwargs"]["accumulate_grad_batches"], REFERENCE.lr, REFERENCE.warmup_steps
    )
    single = run_processes(fit_cases, 1, {"fixed": one, "unscaled": unscaled}, timeout=300)[0]
    two = _fixed_case(2)
    per_rank = run_processes(fit_cases, 2, {"fixed": two}, timeout=300)
    acc1, acc2 = one["trainer_kwargs"]["accumulate_grad_batches"], two["trainer_kwargs"]["accumulate_grad_batches"]
    assert (acc1, acc2) == (4, 2)
    reference = per_step(single["fixed"], acc1)
    assert len(reference) == STEPS and reference[-1] < reference[0]  # it trained
    for rank, result in enumerate(per_rank):
        assert max_abs_difference(per_step(result["fixed"], acc2), reference) < 1e-5, f"rank {rank}"
    # Negative control: the comparison can fail (the unscaled run sees half the samples per step).
    assert max_abs_difference(per_step(single["unscaled"], acc2), reference) > 1e-3
