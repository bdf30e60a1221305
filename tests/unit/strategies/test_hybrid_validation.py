"""Layout and configuration errors of the hybrid strategy, raised before any process group exists."""

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_parallel  # noqa: F401 - registers the strategies
from examples.nlp.model import GPT
from lightning_parallel.parallel.compose import check_module
from lightning_parallel.strategies import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_parallel.testing.models import ResidualMLP


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 1}, "deepspeed_zero1"),
        ({"pipeline_parallel_size": 0}, "must be >= 1"),
        ({"tensor_parallel_size": "two"}, "positive integer"),
        ({"partition": "random"}, "Unknown partition"),
        ({"loss_parallel": True}, "tensor_parallel_size > 1"),
        ({"sequence_parallel": True}, "tensor_parallel_size > 1"),
        ({"schedule": "zbv"}, "exactly two stages"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("world", "kwargs", "model", "message"),
    [
        (8, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 1}, "mlp", "product is 8"),
        (6, {"tensor_parallel_size": 4}, "mlp", "multiple of 4"),
        (
            8, {"pipeline_parallel_size": 8, "microbatches": 8, "data_parallel_size": 1}, "mlp",
            "fewer than the 8 stages",
        ),
        # Micro-batches against stages are checked once the world is known, after the sizes against it.
        (
            4, {"pipeline_parallel_size": 4, "microbatches": 2, "data_parallel_size": 1}, "mlp",
            "at least as many micro-batches",
        ),
        (4, {"tensor_parallel_size": 4, "data_parallel_size": 1}, "gpt3heads", "heads"),
        (
            2, {"tensor_parallel_size": 2, "data_parallel_size": 1, "plan": {"blocks.*.nothing": "colwise"}}, "gpt",
            "matches no submodule",
        ),
    ],
)
def test_invalid_layouts_for_a_model_raise_naming_the_fix(world, kwargs, model, message):
    module = {
        "mlp": lambda: ResidualMLP(width=16, depth=4),
        "gpt": lambda: GPT(d_model=32, n_layer=2, n_head=4, seq_len=16).build(),
        "gpt3heads": lambda: GPT(d_model=24, n_layer=2, n_head=3, seq_len=16).build(),
    }[model]()
    strategy = HybridParallelStrategy(**kwargs)
    with pytest.raises(ValueError, match=message):
        check_module(module, strategy.resolve_layout(world), strategy.options)


def test_presets_are_the_hybrid_strategy_with_sizes_of_one():
    assert PipelineParallelStrategy().resolve_layout(4).shape == (1, 4, 1)
    assert PipelineParallelStrategy(pipeline_parallel_size=2).resolve_layout(4).shape == (2, 2, 1)
    assert TensorParallelStrategy().resolve_layout(2).shape == (1, 1, 2)
    assert HybridParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2).resolve_layout(8).shape == (2, 2, 2)
    assert issubclass(PipelineParallelStrategy, HybridParallelStrategy)
    assert issubclass(TensorParallelStrategy, HybridParallelStrategy)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("hybrid_parallel", HybridParallelStrategy),
        ("pipeline_parallel", PipelineParallelStrategy),
        ("tensor_parallel", TensorParallelStrategy),
    ],
)
def test_names_are_registered_on_import(name, cls):
    assert StrategyRegistry[name]["strategy"] is cls
    assert isinstance(StrategyRegistry.get(name), cls)
