"""What each precision means per mesh axis: the checks, FSDP2's policy and DeepSpeed's blocks (no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.precision import check_precision, describe_precision, fsdp_policy, upcast_for_reduction
from lightning_parallel.parallel.tensor.styles import SumGradients
from lightning_parallel.strategies.deepspeed.config import apply_precision

DP2 = ParallelLayout(2, 2, 1, 1)
TP2 = ParallelLayout(2, 1, 1, 2)
DP2_TP2 = ParallelLayout(4, 2, 1, 2)


def _options(layout: ParallelLayout, **kwargs) -> ParallelOptions:
    return ParallelOptions(layout.data_parallel, layout.pipeline_parallel, layout.tensor_parallel, **kwargs)


@pytest.mark.parametrize(
    ("layout", "zero_stage", "precision", "param", "reduce"),
    [
        (DP2, 2, "bf16-mixed", torch.bfloat16, torch.float32),  # torchtitan's default policy
        (DP2, 3, "bf16-mixed", torch.bfloat16, torch.float32),
        (DP2_TP2, 2, "bf16-mixed", None, None),  # fp32 parameters (autocast computes): TP all-reduces fp32 gradients
        (DP2, 0, "bf16-mixed", None, None),  # replicated: DDP's fp32 parameters under autocast, no policy needed
        (DP2, 2, "bf16-true", None, torch.float32),  # bf16 parameters, fp32 reduce-scatter
        (DP2, 0, "bf16-true", None, torch.float32),  # bf16 gradients all-reduced in fp32
        (DP2, 2, "32-true", None, None),
    ],
)
def test_fsdp_policy_by_precision_and_layout(layout, zero_stage, precision, param, reduce):
    options = _options(layout, zero_stage=zero_stage)
    check_precision(precision, options, layout)
    policy = fsdp_policy(precision, options, layout)
    if param is None and reduce is None:
        assert policy is None
    else:
        assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)


def test_explicit_dtypes_override_the_choice():
    options = _options(DP2, zero_stage=2, param_dtype="float32", reduce_dtype="bfloat16")
    policy = fsdp_policy("bf16-mixed", options, DP2)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float32, torch.bfloat16)
    assert "gradients reduced in bf16" in describe_precision("bf16-mixed", options, DP2)


@pytest.mark.parametrize(
    ("layout", "kwargs", "precision", "match"),
    [
        (DP2, {}, "16-mixed", "not supported.*bf16-mixed"),
        (DP2, {}, "64-true", "not supported"),
        (DP2, {"param_dtype": "bfloat16"}, "bf16-mixed", "zero_stage=0 nothing is sharded.*zero_stage=2 or 3"),
        (TP2, {"reduce_dtype": "bfloat16"}, "bf16-mixed", "no data axis to reduce over"),
        (DP2, {"zero_stage": 2, "param_dtype": "bfloat16"}, "bf16-true", "no effect.*bf16-true"),
        (DP2_TP2, {"zero_stage": 2, "param_dtype": "bfloat16"}, "bf16-mixed", "pytorch#190626.*Drop param_dtype"),
        (TP2, {"sequence_parallel": True}, "bf16-true", "bf16-true.*sequence_parallel.*bf16-mixed"),
    ],
)
def test_combinations_that_would_reduce_in_bf16_or_do_nothing_are_refused(layout, kwargs, precision, match):
    with pytest.raises(ValueError, match=match):
        check_precision(precision, _options(layout, **kwargs), layout)


@pytest.mark.parametrize(("name", "value"), [("param_dtype", "fp16"), ("reduce_dtype", None), ("reduce_dtype", "half")])
def test_dtype_options_are_validated_at_construction(name, value):
    with pytest.raises(ValueError, match=f"{name}=.*'float32' or 'bfloat16'"):
        ParallelOptions(**{name: value})


def test_start_up_row_says_what_runs_in_bf16():
    row = describe_precision("bf16-mixed", _options(DP2, zero_stage=3), DP2)
    assert row.startswith("bf16-mixed: compute bf16 autocast, weights + optimizer state fp32")
    assert "parameters bf16 in compute, gradients reduced in fp32" in row
    assert "weights + optimizer state bf16 (bf16-true)" in describe_precision("bf16-true", _options(TP2), TP2)


def test_upcast_for_reduction_copies_low_precision_only():
    bf16, fp32 = torch.ones(3, dtype=torch.bfloat16), torch.ones(3)
    assert upcast_for_reduction(bf16).dtype == torch.float32
    assert upcast_for_reduction(fp32) is fp32


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_deepspeed_bf16_mixed_is_torch_autocast_with_fp32_reductions(device):
    config = apply_precision({}, "bf16-mixed", device)
    assert config == {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
    config = apply_precision({}, "bf16-true", device)
    assert config == {"bf16": {"enabled": True}, "communication_data_type": "fp32"}


def test_deepspeed_raw_config_contradicting_fp32_reductions_is_refused():
    with pytest.raises(ValueError, match="communication_data_type='bf16'"):
        apply_precision({"communication_data_type": "bf16"}, "bf16-true", "cpu")
    with pytest.raises(ValueError, match="bf16-mixed is torch_autocast"):
        apply_precision({"bf16": {"enabled": True}}, "bf16-mixed", "cpu")


def test_replicated_grad_sum_reduces_bf16_gradients_in_fp32(monkeypatch):
    # SumGradients' backward hook, with the collective replaced by a recorder (one rank: the sum is the input).
    import torch.distributed as dist

    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: seen.append(tensor.dtype))
    norm = torch.nn.LayerNorm(4).to(torch.bfloat16)

    class _Mesh:
        def get_group(self):
            return None

    SumGradients()._apply(norm, _Mesh())
    norm(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert seen == [torch.float32, torch.float32]
    assert norm.weight.grad.dtype == torch.bfloat16


def test_the_hybrid_strategy_refuses_before_any_process_group():
    import torch.distributed as dist

    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

    trainer = quiet_trainer(1, HybridParallelStrategy(data_parallel_size=1), 1, [], precision="16-true")
    with pytest.raises(ValueError, match="precision='16-true' is not supported"):
        trainer.fit(ResidualMLP(), datamodule=FixedOrderData(regression_dataset(16, 32), batch_size=8))
    assert not dist.is_initialized()


def test_tied_copy_gradients_are_exchanged_and_summed_in_fp32(monkeypatch):
    # Rank 0 of a tied pair (embedding and head on two pipeline ranks) under bf16-true, the peer faked.
    import torch.distributed as dist

    from lightning_parallel.parallel.pipeline.tied import TiedCopies, sum_tied_gradients

    exchanged = []

    def exchange(ops):
        send, recv = ops
        exchanged.append((send.tensor.dtype, recv.tensor.dtype))
        recv.tensor.fill_(3 * 2.0**-9)  # the peer's contribution this step
        return []

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: type("Op", (), {"tensor": tensor})())
    monkeypatch.setattr(dist, "batch_isend_irecv", exchange)
    head = torch.nn.Linear(2, 2, bias=False).to(torch.bfloat16)
    before = [torch.full((2, 2), 0.5, dtype=torch.bfloat16)]  # an accumulation window already holds 0.5
    head.weight.grad = torch.full((2, 2), 1.5, dtype=torch.bfloat16)  # this step added 1.0
    sum_tied_gradients(head, [TiedCopies("weight", (0, 1), 0)], before)
    assert exchanged == [(torch.float32, torch.float32)]
    expected = (torch.tensor(0.5) + torch.tensor(1.0) + 3 * 2.0**-9).to(torch.bfloat16)  # one rounding, at the end
    assert torch.equal(head.weight.grad, expected.expand(2, 2))
