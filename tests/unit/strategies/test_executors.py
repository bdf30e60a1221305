"""choose_executor and DirectExecutor (no processes): who gets token weighting, and only during training steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.adapters.hf.loss import TokenWeightedLoss  # noqa: E402
from lightning_parallel.layout import DATA_PARALLEL  # noqa: E402
from lightning_parallel.strategies.hybrid.executors import DirectExecutor, choose_executor  # noqa: E402


def _holder(accumulation: int = 1) -> nn.Module:
    torch.manual_seed(0)
    holder = nn.Module()
    holder.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8,
    ))
    holder.trainer = SimpleNamespace(accumulate_grad_batches=accumulation)
    return holder


def _strategy(module: nn.Module, data_parallel: int = 2) -> SimpleNamespace:
    mesh = {DATA_PARALLEL: SimpleNamespace(get_group=lambda: None)}
    # loss_group: the ranks losses average over (data x context); None: the default group in these tests
    return SimpleNamespace(lightning_module=module, device_mesh=mesh, global_rank=0,
                           loss_group=lambda: (None, data_parallel))


def _parallelized(module: nn.Module, data_parallel: int) -> SimpleNamespace:
    """What parallelize returns, as far as choose_executor reads it: the adapter the strategy resolved once."""
    layout = SimpleNamespace(data_parallel=data_parallel, data_parallel_enabled=data_parallel > 1)
    return SimpleNamespace(pipelined=False, layout=layout, options=SimpleNamespace(loss_parallel=False),
                           adapter=adapt(module))


@pytest.mark.parametrize(("data_parallel", "weighted"), [(1, False), (2, True)])
def test_direct_executor_token_weights_a_causal_lm_under_data_parallelism(data_parallel, weighted):
    module = _holder()
    executor = choose_executor(_strategy(module, data_parallel), _parallelized(module, data_parallel))
    assert type(executor) is DirectExecutor
    assert isinstance(executor.weighting, TokenWeightedLoss) is weighted
    if weighted:
        assert executor.weighting.model is module.model
        assert executor.weighting.data_parallel_size == 2


def test_a_module_without_a_hugging_face_model_is_not_weighted():
    plain = nn.Linear(2, 2)
    plain.trainer = SimpleNamespace(accumulate_grad_batches=1)
    assert choose_executor(_strategy(plain), _parallelized(plain, 2)).weighting is None


def test_weighting_is_active_during_training_and_evaluation_steps_only():
    module = _holder()
    calls: list[float] = []

    def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:  # one rank standing for two equal ones
        calls.append(float(value))
        return value.mul_(2)

    ids = torch.tensor([[1, 2, 3, 0]])
    batch = {"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": ids.masked_fill(ids == 0, -100)}
    executor = DirectExecutor(weighting=TokenWeightedLoss(module.model, sum_over_ranks, 2))
    loss = executor.training_step(lambda: module.model(**batch).loss, batch, 0)
    assert len(calls) == 2  # the count before forward, the shared value after
    with torch.no_grad():
        assert abs(float(loss) - float(module.model(**batch).loss)) < 1e-6  # two equal ranks: the same mean
        assert len(calls) == 2  # a call outside a step runs no collective
        value = executor.evaluation_step(lambda: module.model(**batch).loss, batch, "val_loss")
    assert len(calls) == 4  # a validation loss is the global token mean too
    assert abs(float(value) - float(loss)) < 1e-6
