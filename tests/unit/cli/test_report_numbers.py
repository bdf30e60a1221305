"""The end-of-run table shows numbers as people read them."""

import pytest

from lightning_parallel.cli.report import readable


@pytest.mark.parametrize("value, shown", [
    (0.0004, "4.0e-4"), (-0.00123, "-1.2e-3"), (3e-12, "3.0e-12"), (float("nan"), "—"), (float("inf"), "∞"),
    (4.28751234, "4.2875"), (0.0123, "0.0123"), (851.234, "851.2"), (54321.7, "54,322"),
    (8.0, "8"), (0.0, "0"), (123456.0, "123,456"), (3, "3"), (True, "True"), ("text", "text"),
])
def test_readable_shows_small_numbers_in_scientific_form_nan_as_a_dash_and_large_ones_grouped(value, shown):
    assert readable(value) == shown
