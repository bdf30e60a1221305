"""``offload="params"`` (FSDP2's CPUOffloadPolicy) on 2 gloo processes trains as without it.

On a CPU device the policy moves nothing (the device memory is the host memory), but FSDP2's
offload code path runs: shards copied to the mesh device for each all-gather, reduced gradients
copied to the CPU, the optimizer stepping on CPU state. The numbers must not change: dp2 ZeRO-3
(and ZeRO-2), fp32, AdamW, clipping 0.5, 10 steps, ResidualMLP, every rank within 1e-6 of the same
fit without offload. The memory it saves can only show on an accelerator: ``tests/gpu/test_offload_cuda.py``.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_losses

pytestmark = pytest.mark.slow

TOL = 1e-6
STEPS = 10


def _case(stage, offload):
    return dict(strategy=partial(Hybrid, zero_stage=stage, offload=offload), global_batch=16, data_parallel=2,
                steps=STEPS, optimizer="adamw", trainer_kwargs={"gradient_clip_val": 0.5})


def fit_recording_policies(rank: int, world_size: int, cases: dict) -> dict:
    """Each case's losses and the offload policies ``fully_shard`` was given in it (on this rank)."""
    import torch.distributed.fsdp as fsdp

    original, policies = fsdp.fully_shard, []

    def record(module, **kwargs):
        policies.append(type(kwargs.get("offload_policy")).__name__)
        return original(module, **kwargs)

    fsdp.fully_shard = record
    try:
        results = {}
        for name, case in cases.items():
            policies.clear()
            results[name] = (fit_losses(rank, world_size, **case), sorted(set(policies)))
        return results
    finally:
        fsdp.fully_shard = original


@pytest.mark.parametrize("stage", [3, 2])
def test_offload_params_matches_no_offload_on_every_rank(stage):
    cases = {"offload": _case(stage, "params"), "device": _case(stage, "none")}
    per_rank = run_processes(fit_recording_policies, 2, cases, timeout=600)
    diffs = []
    for rank, results in enumerate(per_rank):
        (on, on_policies), (off, off_policies) = results["offload"], results["device"]
        assert on_policies == ["CPUOffloadPolicy"], f"rank {rank}: offload='params' gave {on_policies}"
        assert off_policies == ["OffloadPolicy"], f"rank {rank}: offload='none' gave {off_policies}"
        assert len(on) == len(off) == STEPS and abs(off[0] - off[-1]) > 1e-3  # it trained: a real comparison
        diffs.append(max_abs_difference(on, off))
    print(f"zero_stage={stage}: max |loss diff| per rank, offload vs none: {diffs}")
    assert max(diffs) < TOL, diffs
