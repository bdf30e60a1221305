"""The context plan's checks: any dropout in a model split along the sequence is refused with the fix."""

import pytest

from lightning_parallel.examples.nlp.model import GPT
from lightning_parallel.parallel.context.plan import matching_plan


def _gpt(dropout):
    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=4, dropout=dropout)
    model.configure_model()  # the recipe builds its layers there
    return model


def test_a_model_without_dropout_passes_and_its_attention_is_found():
    model = _gpt(0.0)
    assert "attention" in matching_plan(model, model.context_parallel_plan(), "GPT").values()


def test_attention_dropout_is_refused_with_the_fix():
    model = _gpt(0.1)
    with pytest.raises(ValueError, match="attention dropout 0.1.*dropout to 0"):
        matching_plan(model, model.context_parallel_plan(), "GPT")


def test_dropout_outside_attention_is_refused_naming_the_modules_and_the_fix():
    model = _gpt(0.1)
    for name, module in model.named_modules():
        if name.endswith("attn.core"):
            module.dropout = 0.0  # only the residual and embedding dropouts left
    with pytest.raises(ValueError, match=r"embed\.drop \(p=0\.1\).*model\.dropout=0"):
        matching_plan(model, model.context_parallel_plan(), "GPT")
