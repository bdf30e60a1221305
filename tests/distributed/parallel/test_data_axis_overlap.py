"""Replicated data parallelism reduces gradients during backward, bucket by bucket, and not in accumulation micro-steps.

Two processes, ``zero_stage=0`` on ``dp2`` (the plain axis: torch's DDP, ``parallel/replicated.py``): every bucket
all-reduce (logged by a DDP communication hook that then all-reduces as DDP's default does) and the moment the first
layer's backward starts are logged in order. The first layer is the last to get its gradient, so all-reduces logged
before it were issued while backward was still running (the overlap of DDP's buckets), and the gradients found when
backward returns already equal one process's full-batch gradients. Inside ``deferred_gradient_sync`` a backward
issues no collective at all, and the next synchronised backward reduces the sum.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.data import deferred_gradient_sync
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.testing import run_processes
from lightning_parallel.testing.models import ResidualMLP

pytestmark = pytest.mark.slow
BATCH, WIDTH, TOL = 8, 32, 1e-6


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p.grad).detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _logged(events: list) -> tuple[int, int, int]:
    """(buckets reduced before the first layer's backward started, buckets in all, Python all-reduces)."""
    first_layer = events.index("first layer backward")
    return (sum(e == "bucket" for e in events[:first_layer]), sum(e == "bucket" for e in events),
            events.count("all_reduce"))


def _run(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    reference = ResidualMLP(width=WIDTH, depth=3)
    module = copy.deepcopy(reference)
    layout = ParallelLayout(2, 2, 1, 1)
    meshes = RunMeshes.build(layout, "cpu", 0)
    bucketed = copy.deepcopy(reference)  # DDP's default 25 MB bucket holds this whole model: one all-reduce
    wrapped = [parallelize(target, meshes=meshes, options=options, adapter=adapt(target)).replicated
               for target, options in ((module, ParallelOptions(data_parallel_size=2, bucket_size_mb=0)),
                                       (bucketed, ParallelOptions(data_parallel_size=2)))]
    events: list = []
    module.pipeline_layers()[0].register_full_backward_pre_hook(lambda *_: events.append("first layer backward"))
    original = dist.all_reduce
    for ddp in wrapped:
        ddp.register_comm_hook(None, _logged_hook(events))
    ddp_module, ddp_bucketed = wrapped

    def logged_all_reduce(*args, **kwargs):  # any all-reduce from Python (there should be none)
        events.append("all_reduce")
        return original(*args, **kwargs)

    x, y = torch.randn(2, BATCH, WIDTH), torch.randn(2, BATCH, WIDTH)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for model, ddp in ((module, ddp_module), (bucketed, ddp_bucketed)):  # DDP sizes its buckets in the first step
        model.pipeline_loss(ddp(x[0, half]), y[0, half]).backward()
        model.zero_grad(set_to_none=True)
    events.clear()
    dist.all_reduce = logged_all_reduce
    try:
        module.pipeline_loss(ddp_module(x[0, half]), y[0, half]).backward()
        synced = _logged(events)
        one_step = _grads(module)
        module.zero_grad(set_to_none=True)
        events.clear()
        with deferred_gradient_sync(ddp_module, zero_stage=0, hsdp=False):
            (module.pipeline_loss(ddp_module(x[0, half]), y[0, half]) / 2).backward()
        deferred = events.count("bucket")
        events.clear()
        (module.pipeline_loss(ddp_module(x[1, half]), y[1, half]) / 2).backward()
        accumulated_calls = events.count("bucket")
        events.clear()
        bucketed.pipeline_loss(ddp_bucketed(x[0, half]), y[0, half]).backward()
        bucket_calls = events.count("bucket")
    finally:
        dist.all_reduce = original
    accumulated = _grads(module)
    reference.pipeline_loss(reference(x[0]), y[0]).backward()
    expected_one = _grads(reference)
    reference.zero_grad(set_to_none=True)
    for i in range(2):
        (reference.pipeline_loss(reference(x[i]), y[i]) / 2).backward()
    return {"synced": synced, "deferred": deferred, "accumulated_calls": accumulated_calls,
            "bucket_calls": bucket_calls, "bucketed": _max_diff(_grads(bucketed), expected_one),
            "one_step": _max_diff(one_step, expected_one), "accumulated": _max_diff(accumulated, _grads(reference)),
            "units": len(list(module.parameters())), "plain": all(type(p) is torch.nn.Parameter
                                                                  for p in module.parameters())}


def _logged_hook(events: list):
    """A DDP communication hook that logs each bucket, then all-reduces and averages it as DDP's default does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        events.append("bucket")
        return allreduce_hook(state, bucket)

    return hook


def test_replicated_gradients_are_reduced_during_backward_and_deferred_in_micro_steps():
    for result in run_processes(_run, 2, timeout=300):
        before_first_layer, total, python_calls = result["synced"]
        # bucket_size_mb=0: one bucket per parameter; the later layers' ones are issued before the first layer's
        # backward starts, i.e. before backward returns. The one all-reduce per bucket is the hook's: nothing else
        # communicates; parameters stay plain tensors.
        assert total == result["units"] and before_first_layer >= result["units"] - 4, result
        assert python_calls == total and result["plain"], result
        assert result["one_step"] < TOL, result
        assert result["deferred"] == 0, result  # accumulation micro-step: no communication
        assert result["accumulated_calls"] == result["units"], result
        assert result["accumulated"] < TOL, result
        assert result["bucket_calls"] == 1 and result["bucketed"] < TOL, result
