"""Tools to test parallel layouts on CPU: a multi-process runner, loss recorders, and layout comparisons."""

from lightning_parallel.testing.assertions import assert_cases_match, assert_layouts_match
from lightning_parallel.testing.compare import Case, Layout, StepRecorder, compare_cases, compare_layouts
from lightning_parallel.testing.parity import BatchHistory, LossHistory, max_abs_difference
from lightning_parallel.testing.processes import DistributedRunError, free_port, run_processes
from lightning_parallel.testing.results import LayoutComparison

__all__ = [
    "BatchHistory", "Case", "DistributedRunError", "Layout", "LayoutComparison", "LossHistory", "StepRecorder",
    "assert_cases_match", "assert_layouts_match", "compare_cases", "compare_layouts", "free_port",
    "max_abs_difference", "run_processes",
]
