"""Scaling rules: worked examples from docs/scaling.md, and impossible requests."""

import math
from pathlib import Path

import pytest

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.scaling import RULES, Reference, rescale, rescale_for_layout

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


def test_fixed_global_batch_on_a_data_parallel_size_that_cannot_divide_names_the_fix():
    # docs/scaling.md: on 3 devices no micro-batch reaches 256; the message names device counts that can.
    with pytest.raises(ValueError, match=r"data-parallel size 3 does not divide 256.*\[1, 2, 4, 8\]"):
        rescale("fixed_global_batch", REF, data_parallel=3, micro_batch_size=32)


def test_fixed_global_batch_with_a_micro_batch_that_cannot_divide_names_the_fix():
    with pytest.raises(ValueError, match=r"data.batch_size.*\[4, 8, 16, 32, 64, 128\]"):
        rescale("fixed_global_batch", REF, data_parallel=2, micro_batch_size=48)


def test_none_keeps_configured_values_and_counts_only_data_parallel():
    eff = rescale(
        "none", Reference(), data_parallel=2, micro_batch_size=16, accumulate_grad_batches=2, lr=3e-3, warmup_steps=7
    )
    assert (eff.global_batch_size, eff.lr, eff.warmup_steps) == (64, 3e-3, 7)


@pytest.mark.parametrize("rule", ["linear", "sqrt", "fixed_global_batch"])
def test_rules_need_a_reference(rule):
    with pytest.raises(ValueError, match="reference"):
        rescale(rule, Reference(), data_parallel=2, micro_batch_size=16, lr=None)


def test_unknown_rule():
    with pytest.raises(ValueError, match="choose one of"):
        rescale("cubic", REF, data_parallel=1, micro_batch_size=1)


def test_linear_rule_on_more_devices_scales_lr_up_and_warmup_down():
    eff = rescale("linear", REF, data_parallel=32, micro_batch_size=32)
    assert (eff.global_batch_size, eff.warmup_steps) == (1024, 25)
    assert math.isclose(eff.lr, 4e-3)


def test_pipeline_and_tensor_sizes_do_not_change_the_global_batch():
    from lightning_parallel.strategies import HybridParallelStrategy

    # 8 devices as dp2 x pp2 x tp2: only the 2 data-parallel replicas see different samples.
    layout = HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2).resolve_layout(8)
    assert layout.describe() == "dp2 x pp2 x tp2"
    for rule in ("none", "linear", "sqrt", "fixed_global_batch"):
        on_hybrid = rescale_for_layout(rule, REF, layout, micro_batch_size=32, lr=1e-3)
        on_two = rescale(rule, REF, data_parallel=2, micro_batch_size=32, lr=1e-3)
        assert on_hybrid == on_two, rule
    assert rescale_for_layout("fixed_global_batch", REF, layout, micro_batch_size=32).accumulate_grad_batches == 4


def test_effective_values_as_a_reference_reproduce_the_run_elsewhere():
    run = rescale("sqrt", REF, data_parallel=2, micro_batch_size=32)
    again = rescale("fixed_global_batch", run.as_reference(), data_parallel=4, micro_batch_size=16)
    assert (again.global_batch_size, again.lr, again.warmup_steps) == (run.global_batch_size, run.lr, run.warmup_steps)
    assert again.accumulate_grad_batches == 1


@pytest.mark.parametrize("bad", [{"data_parallel": 0}, {"micro_batch_size": 0}, {"accumulate_grad_batches": -1}])
def test_non_positive_sizes_are_refused(bad):
    kwargs = {"data_parallel": 2, "micro_batch_size": 32, **bad}
    with pytest.raises(ValueError, match="positive integer"):
        rescale("linear", REF, **kwargs)


def _readme_examples():
    """Rows of docs/scaling.md's worked examples (rule, devices, layout, micro, acc, global batch, lr, warm-up)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in RULES and cells[2].startswith("dp"):
            rows.append(cells)
    return rows


README_EXAMPLES = _readme_examples()


def test_readme_has_worked_examples_for_every_rule_but_none():
    assert {row[0] for row in README_EXAMPLES} == {"linear", "sqrt", "fixed_global_batch"}
    assert any("pp2 x tp2" in row[2] for row in README_EXAMPLES)


@pytest.mark.parametrize("row", README_EXAMPLES, ids=[f"{r[0]}-{r[1]}dev-{r[2]}" for r in README_EXAMPLES])
def test_readme_worked_example(row):
    rule, devices, layout_text, micro, acc, global_batch, lr, warmup = row
    dp, pp, tp = (int(part.strip()[2:]) for part in layout_text.split("x"))
    layout = ParallelLayout.resolve(int(devices), data_parallel=dp, pipeline_parallel=pp, tensor_parallel=tp)
    eff = rescale_for_layout(rule, REF, layout, micro_batch_size=int(micro))
    assert (eff.accumulate_grad_batches, eff.global_batch_size, eff.warmup_steps) == (
        int(acc), int(global_batch), int(warmup)
    )
    assert math.isclose(eff.lr, float(lr), rel_tol=1e-9)
