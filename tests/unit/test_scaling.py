"""Scaling rules: worked examples from the README, and impossible requests."""

import math

import pytest

from lightning_parallel.scaling import Reference, rescale

REF = Reference(global_batch_size=256, lr=1e-3, warmup_steps=100, devices=8)


def test_linear_rule_on_fewer_devices_scales_lr_down():
    # Reference: batch 256 = 32 per device x 8 devices at lr 1e-3. On 2 devices: batch 64.
    eff = rescale("linear", REF, data_parallel=2, micro_batch_size=32)
    assert eff.global_batch_size == 64
    assert math.isclose(eff.lr, 2.5e-4)
    assert eff.warmup_steps == 400  # same warm-up samples


def test_sqrt_rule():
    eff = rescale("sqrt", REF, data_parallel=2, micro_batch_size=32)
    assert math.isclose(eff.lr, 5e-4)


def test_fixed_global_batch_chooses_accumulation():
    eff = rescale("fixed_global_batch", REF, data_parallel=2, micro_batch_size=32)
    assert (eff.accumulate_grad_batches, eff.global_batch_size, eff.lr, eff.warmup_steps) == (4, 256, 1e-3, 100)


def test_fixed_global_batch_that_cannot_divide_names_the_fix():
    with pytest.raises(ValueError, match="data.batch_size"):
        rescale("fixed_global_batch", REF, data_parallel=3, micro_batch_size=32)


def test_none_keeps_configured_values_and_counts_only_data_parallel():
    eff = rescale("none", Reference(), data_parallel=2, micro_batch_size=16, accumulate_grad_batches=2, lr=3e-3, warmup_steps=7)
    assert (eff.global_batch_size, eff.lr, eff.warmup_steps) == (64, 3e-3, 7)


@pytest.mark.parametrize("rule", ["linear", "sqrt", "fixed_global_batch"])
def test_rules_need_a_reference(rule):
    with pytest.raises(ValueError, match="reference"):
        rescale(rule, Reference(), data_parallel=2, micro_batch_size=16, lr=None)


def test_unknown_rule():
    with pytest.raises(ValueError, match="choose one of"):
        rescale("cubic", REF, data_parallel=1, micro_batch_size=1)
