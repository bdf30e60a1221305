"""One resolution of the layout: a strategy as an object, a class, a partial or a registered name runs one layout."""

from functools import partial

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_parallel.cli.preflight import SETTING_NAMES, layout_of
from lightning_parallel.strategies import STRATEGIES, HybridParallelStrategy, PipelineParallelStrategy
from lightning_parallel.strategies.resolve import resolve_layout, strategy_object

WORLD = 4
# Every name the suite registers -> its (data, pipeline, tensor) layout on WORLD ranks;
# Lightning's ddp is data parallel.
EXPECTED = {
    "hybrid_parallel": (4, 1, 1),
    "pipeline_parallel": (1, 4, 1),
    "tensor_parallel": (1, 1, 4),
    "deepspeed_zero1": (4, 1, 1),
    "deepspeed_zero2": (4, 1, 1),
    "deepspeed_zero3": (4, 1, 1),
    "deepspeed_zero3_offload": (4, 1, 1),
    "ddp": (4, 1, 1),
    "context_parallel": (1, 1, 1),  # every rank splits the sequence: context 4
    "torchrec": (4, 1, 1),
}


def _suite_names() -> set[str]:
    return {name for name, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES}


def test_every_registered_name_of_the_suite_is_covered():
    assert _suite_names() == set(EXPECTED) - {"ddp"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_registered_name_resolves_to_the_layout_its_strategy_runs(name):
    if name == "torchrec":
        pytest.importorskip("torchrec", reason="pip install -e '.[recsys]' && pip install --no-deps torchrec")
    layout = resolve_layout(name, WORLD)
    assert layout.shape == EXPECTED[name]
    built = StrategyRegistry.get(name)  # what the Trainer builds from the name
    if hasattr(built, "resolve_layout"):
        assert built.resolve_layout(WORLD).shape == layout.shape
    assert layout_of(name, WORLD).shape == layout.shape  # lp-train's preflight asks the same function


def test_object_class_partial_and_name_agree():
    two = partial(PipelineParallelStrategy, pipeline_parallel_size=2)
    forms = [PipelineParallelStrategy(pipeline_parallel_size=2), two, lambda: two(), "pipeline_parallel"]
    shapes = [resolve_layout(form, 2).shape for form in forms]
    assert shapes == [(1, 2, 1)] * 4
    assert resolve_layout(PipelineParallelStrategy, 2).shape == (1, 2, 1)
    assert resolve_layout(partial(HybridParallelStrategy, tensor_parallel_size=2), 4).shape == (2, 1, 2)


def test_lightnings_own_strategies_are_data_parallel_without_being_built():
    assert resolve_layout("auto", 1).shape == (1, 1, 1)
    assert resolve_layout(DDPStrategy, 3).shape == (3, 1, 1)
    assert resolve_layout(DDPStrategy(), 2).shape == (2, 1, 1)
    assert strategy_object("ddp") is None and strategy_object(DDPStrategy) is None
    assert isinstance(strategy_object("tensor_parallel"), HybridParallelStrategy)


def test_errors_name_the_settings_as_the_caller_spells_them():
    with pytest.raises(ValueError, match="strategy.pipeline_parallel_size"):
        resolve_layout(partial(PipelineParallelStrategy, pipeline_parallel_size=3), 4, names=SETTING_NAMES)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        resolve_layout(partial(PipelineParallelStrategy, pipeline_parallel_size=3), 4)


def test_a_private_registry_is_honoured():
    registry = {"mine": {"strategy": PipelineParallelStrategy, "init_params": {"pipeline_parallel_size": 2}}}
    assert resolve_layout("mine", 4, registry=registry).shape == (2, 2, 1)
    assert resolve_layout("pipeline_parallel", 4, registry=registry).shape == (4, 1, 1)  # not in it: data parallel
