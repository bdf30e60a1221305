"""A strategy given to compare_layouts by its registered name feeds the data the layout it runs.

Regression: ``("pipeline_parallel", 2)`` used to hand the data module data 2 x pipeline 1 while the
strategy ran pipeline 2 x data 1, so every step trained on half the batch (0.088 at step 0 on this
model). The name now resolves through :func:`lightning_parallel.strategies.resolve.resolve_layout`,
like an object or a ``functools.partial`` of the class.
"""

from functools import partial

import pytest

from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

WIDTH = 16
BATCH = 8  # one process's batch; pipeline 2 x data 1 serves all 8 in 4 micro-batches of 2


def fixed_order_data(layout) -> FixedOrderData:
    return FixedOrderData(regression_dataset(4 * BATCH, WIDTH), batch_size=BATCH // layout.data_parallel)


def test_pipeline_parallel_by_name_matches_one_process(assert_layouts_match):
    result = assert_layouts_match(partial(ResidualMLP, width=WIDTH, depth=2, optimizer="sgd"), fixed_order_data,
                                  [("auto", 1), ("pipeline_parallel", 2)], steps=2, timeout=300)
    assert [run.name for run in result.runs] == ["auto:1", "pipeline_parallel:2"]
