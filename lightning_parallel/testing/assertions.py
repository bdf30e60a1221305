"""Assertions over layout comparisons, for tests (the ``assert_layouts_match`` pytest fixture uses them).

A user's CI proves "my model under dp2 x pp2 matches one process" in a few lines::

    def test_my_model_layouts(assert_layouts_match):
        assert_layouts_match(MyModule, my_data, [("auto", 1), (partial(HybridParallelStrategy,
                             pipeline_parallel_size=2), 4)], steps=5)

The fixture comes with the package (a ``pytest11`` plugin); without pytest, call
:func:`assert_layouts_match` directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_parallel.testing.compare import Case, compare_cases
from lightning_parallel.testing.results import LayoutComparison


def check_comparison(result: LayoutComparison, name: str = "", same_loss_on_every_rank: bool = True) -> None:
    """Raise ``AssertionError`` with the rendered tables unless every layout matches the reference.

    Args:
        result: a comparison.
        name: the case's name, for the message.
        same_loss_on_every_rank: also require every rank of a layout to report the very same losses.
    """
    spread = [d.name for d in result.diffs if d.rank_spread != 0.0] if same_loss_on_every_rank else []
    if not result or spread:
        detail = f"ranks of {spread} report different losses\n" if spread else ""
        raise AssertionError(f"{name + ': ' if name else ''}layouts differ\n{detail}{result.render()}")


def assert_cases_match(
    cases: Mapping[str, Case],
    layouts: Sequence[Any],
    steps: int = 10,
    tolerance: float = 1e-5,
    same_loss_on_every_rank: bool = True,
    **kwargs: Any,
) -> dict[str, LayoutComparison]:
    """:func:`~lightning_parallel.testing.compare.compare_cases`, then :func:`check_comparison` on every case.

    Returns:
        name -> :class:`LayoutComparison` (all matching).
    """
    results = compare_cases(cases, layouts, steps, tolerance, **kwargs)
    for name, result in results.items():
        check_comparison(result, name, same_loss_on_every_rank)
    return results


def assert_layouts_match(
    module_factory: Any,
    datamodule_factory: Any,
    layouts: Sequence[Any],
    steps: int = 10,
    tolerance: float = 1e-5,
    same_loss_on_every_rank: bool = True,
    trainer_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> LayoutComparison:
    """:func:`~lightning_parallel.testing.compare.compare_layouts`, failing with the per-step table unless all match.

    Args:
        module_factory: see ``compare_layouts``.
        datamodule_factory: see ``compare_layouts``.
        layouts: see ``compare_layouts``.
        steps: see ``compare_layouts``.
        tolerance: see ``compare_layouts``.
        same_loss_on_every_rank: also require every rank of a layout to report the very same losses.
        trainer_kwargs: see ``compare_layouts``.
        **kwargs: ``seed``, ``accelerator``, ``timeout``.
    """
    case = Case(module_factory, datamodule_factory, dict(trainer_kwargs or {}))
    return assert_cases_match({"case": case}, layouts, steps, tolerance, same_loss_on_every_rank, **kwargs)["case"]


class LayoutAssertions:
    """What the ``assert_layouts_match`` fixture returns: call it like :func:`assert_layouts_match`;
    ``.cases(...)`` is :func:`assert_cases_match` (several model set-ups, one launch per layout)."""

    def __call__(self, *args: Any, **kwargs: Any) -> LayoutComparison:
        return assert_layouts_match(*args, **kwargs)

    def cases(self, *args: Any, **kwargs: Any) -> dict[str, LayoutComparison]:
        return assert_cases_match(*args, **kwargs)
