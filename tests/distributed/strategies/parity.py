"""Shared assertions for strategy parity tests."""

from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parity_runs import fit_cases

TOL = 1e-5


def reference_losses(cases: dict) -> dict:
    """The same cases on one process with Lightning's single-device strategy."""
    single = {name: {**kw, "strategy": "auto", "data_parallel": 1} for name, kw in cases.items()}
    return run_processes(fit_cases, 1, single)[0]


def assert_parity(per_rank: list, reference: dict, tol: float = TOL) -> dict:
    """Every case on every rank within ``tol`` of the reference; returns the worst difference per case."""
    worst = {}
    for name, ref in reference.items():
        diffs = [max_abs_difference(results[name], ref) for results in per_rank]
        worst[name] = max(diffs)
        assert worst[name] < tol, f"{name}: max |diff| per rank {diffs}"
    return worst
