"""LayoutComparison's verdict and tables, and lp-compare's layout parsing, on hand-made records (no processes)."""

import math

import pytest
import torch

from lightning_parallel.cli.compare import parse_layout
from lightning_parallel.cli.preflight import ConfigError
from lightning_parallel.testing.assertions import check_comparison
from lightning_parallel.testing.compare import Layout, as_layout
from lightning_parallel.testing.results import LayoutComparison, LayoutRun

LOSSES = [2.0, 1.5, 1.2, 1.0]


def _run(name, losses=LOSSES, ranks=1, grad_norms=(3.0, 2.0, 1.0, 0.5), lrs=(1e-3,) * 4, params=None):
    params = {"w": torch.ones(3), "b": torch.zeros(2)} if params is None else params
    return LayoutRun(name, ranks, [list(losses)] * ranks, list(grad_norms), list(lrs), params)


def test_identical_runs_agree_and_print_their_tables():
    result = LayoutComparison.build([_run("single:1"), _run("pipeline:2", ranks=2)], 1e-5)
    assert result and result.first_divergence is None
    text = result.render()
    assert "Δloss pipeline:2" in text and "grad norm single:1" in text and "match" in text
    assert "lp-compare: all 2 layouts agree within 1e-05" in text


def test_a_loss_beyond_tolerance_names_the_layout_and_first_step():
    bad = [*LOSSES[:2], LOSSES[2] + 1e-3, LOSSES[3] + 2e-3]
    result = LayoutComparison.build([_run("single:1"), _run("tensor:2"), _run("pipeline:2", losses=bad)], 1e-5)
    assert not result
    assert result.first_divergence[:3] == (2, "pipeline:2", "loss")
    assert [d.agrees(1e-5) for d in result.diffs] == [True, False]
    assert "pipeline:2 first differs at step 2" in result.verdict()


def test_gradient_norms_are_compared_relative_to_their_size():
    close = _run("b", grad_norms=(300.0, 2.0, 1.0, 0.5))
    result = LayoutComparison.build([_run("a", grad_norms=(300.0 + 1e-3, 2.0, 1.0, 0.5)), close], 1e-5)
    assert result  # 1e-3 on a norm of 300 is 3.3e-6 relative
    far = LayoutComparison.build([_run("a"), _run("b", grad_norms=(3.0, 2.001, 1.0, 0.5))], 1e-5)
    assert not far and far.first_divergence[2] == "grad norm"


def test_parameters_are_compared_by_name():
    moved = _run("b", params={"w": torch.tensor([1.0, 1.0, 1.1]), "b": torch.zeros(2)})
    result = LayoutComparison.build([_run("a"), moved], 1e-5)
    assert not result and result.first_divergence is None
    assert result.worst_parameter[:2] == ("b", "w") and math.isclose(result.worst_parameter[2], 0.1, rel_tol=1e-5)
    missing = LayoutComparison.build([_run("a"), _run("b", params={"w": torch.ones(3)})], 1e-5)
    assert not missing and missing.diffs[0].missing == ["b"]


def test_ranks_that_report_different_losses_fail_the_check():
    run = _run("tensor:2", ranks=2)
    run.losses = [LOSSES, [LOSSES[0] + 1e-7, *LOSSES[1:]]]
    result = LayoutComparison.build([_run("single:1"), run], 1e-5)
    assert result and result.diffs[0].rank_spread > 0
    with pytest.raises(AssertionError, match="report different losses"):
        check_comparison(result)
    check_comparison(result, same_loss_on_every_rank=False)


def test_accumulated_batches_are_averaged_per_step():
    run = LayoutRun("a", 1, [[1.0, 3.0, 2.0, 4.0]], [1.0, 1.0], [0.1, 0.1])
    assert run.step_losses() == [2.0, 3.0]


def test_layout_specs_and_lp_compare_entries():
    assert as_layout(("auto", 1)) == Layout("auto", 1) and as_layout(("ddp", 2)).label == "ddp:2"
    assert parse_layout("pipeline:2") == ("pipeline", 2) and parse_layout(" hybrid : 4") == ("hybrid", 4)
    for bad in ("pipeline", "pipeline:x", ":2", "tensor:0"):
        with pytest.raises(ConfigError, match="NAME:DEVICES"):
            parse_layout(bad)
