"""The pipeline simulation against the textbook bubbles and torch's own action lists."""

from __future__ import annotations

import pytest

from lightning_parallel.parallel.pipeline.timeline import theoretical_bubble
from lightning_parallel.planner.schedule_sim import rank_orders, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_single_stage_schedules_have_the_textbook_bubble(schedule: str, p: int, m: int) -> None:
    sim = simulate(rank_orders(schedule, p, 1, m), [1.0] * p, [2.0] * p, [1.0] * p, transfer=0.0)
    assert sim.step_time == pytest.approx((m + p - 1) * 3.0)
    assert sim.bubble == pytest.approx(theoretical_bubble(p, m))


def test_activations_in_flight_gpipe_holds_all_1f1b_at_most_p() -> None:
    p, m = 4, 8
    gpipe = simulate(rank_orders("gpipe", p, 1, m), [1.0] * p, [2.0] * p, [1.0] * p, 0.0)
    one_f_one_b = simulate(rank_orders("1f1b", p, 1, m), [1.0] * p, [2.0] * p, [1.0] * p, 0.0)
    assert gpipe.peak_in_flight == (m,) * p
    assert one_f_one_b.peak_in_flight == tuple(p - r for r in range(p))


def test_multi_stage_orders_come_from_torch_and_cover_every_action() -> None:
    p, v, m = 2, 2, 4
    for schedule in ("interleaved_1f1b", "zbv", "interleaved_zero_bubble"):
        orders = rank_orders(schedule, p, v, m)
        forwards = sorted((s, mb) for acts in orders.values() for k, s, mb in acts if k == "F")
        assert forwards == sorted((s, mb) for s in range(p * v) for mb in range(m))


def test_interleaving_and_zero_bubble_shrink_the_bubble() -> None:
    p, m = 4, 8
    times = ([1.0] * 4, [2.0] * 4, [1.0] * 4)
    plain = simulate(rank_orders("1f1b", p, 1, m), *times, 0.0)
    half = ([0.5] * 8, [1.0] * 8, [0.5] * 8)  # the same work cut into two stages per rank
    interleaved = simulate(rank_orders("interleaved_1f1b", p, 2, m), *half, 0.0)
    zero_bubble = simulate(rank_orders("interleaved_zero_bubble", p, 2, m), *half, 0.0)
    assert interleaved.bubble < plain.bubble
    assert zero_bubble.bubble < plain.bubble
    assert interleaved.bubble == pytest.approx(theoretical_bubble(p, m, 2), abs=0.05)


def test_transfers_lengthen_the_step() -> None:
    orders = rank_orders("1f1b", 2, 1, 4)
    fast = simulate(orders, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0], 0.0)
    slow = simulate(orders, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0], 0.5)
    assert slow.step_time > fast.step_time
