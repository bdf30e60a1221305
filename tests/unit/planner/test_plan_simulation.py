"""``lp-plan --simulate``'s re-ranking: the simulation's fit wins over the planner's, the planner's order (step time)
stays among the layouts that fit, and those that do not come last, the least over first."""

from lightning_parallel.cli.plan_simulation import SimulatedCandidate, rerank

GB = 1e9


def row(name: str, rank: int, peak: float = None) -> SimulatedCandidate:
    simulated = None if peak is None else peak / 2
    return SimulatedCandidate(name, peak or 0.0, simulated, 0.0, 0.0 if peak else None,
                              None if peak is None else peak <= 80 * GB, planner_rank=rank, peak=peak)


def test_layouts_the_simulation_finds_too_big_drop_below_those_that_fit():
    rows = [row("a", 1, 90 * GB), row("b", 2, 70 * GB), row("c", 3), row("d", 4, 85 * GB), row("e", 5, 10 * GB)]

    assert [r.name for r in rerank(rows, 80 * GB)] == ["b", "c", "e", "d", "a"]  # d is 5 GB over, a 10 GB


def test_the_planner_order_is_kept_when_the_simulation_agrees():
    rows = [row("a", 1, 10 * GB), row("b", 2, 20 * GB), row("c", 3, 30 * GB)]

    assert [r.name for r in rerank(rows, 80 * GB)] == ["a", "b", "c"]
