"""TokenWeightedLoss (no processes): two data-parallel ranks emulated in one process give the one-process loss.

The stand-in for the all-reduce adds what the other rank would contribute, so each "rank" sees
exactly what it would see in a real run; the averaged gradients must equal those of one
process on the concatenated batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.adapters.hf.model import causal_lm_loss_terms, causal_lm_valid_count  # noqa: E402
from lightning_parallel.adapters.hf.loss import TokenWeightedLoss  # noqa: E402

VOCAB, SEQ = 64, 12


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM(config)


def padded_batch(lengths: list[int], prompt: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths; the first ``prompt`` tokens and the padding carry -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), SEQ), generator=gen)
    mask = torch.zeros(len(lengths), SEQ, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class OtherRank:
    """Stands in for ``all_reduce(SUM)``: adds, call by call, what the other rank contributes."""

    def __init__(self, contributions: list[torch.Tensor]) -> None:
        self.contributions = list(contributions)

    def __call__(self, value: torch.Tensor) -> torch.Tensor:
        return value.add_(self.contributions.pop(0).to(value.dtype))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_two_emulated_ranks_give_the_one_process_loss_and_gradients():
    model = tiny_llama()
    batches = [padded_batch([3, 5], prompt=1, seed=1), padded_batch([12, 11], prompt=2, seed=2)]
    counts = [causal_lm_valid_count(b["labels"]) for b in batches]
    total = float(sum(counts))
    assert counts[0] != counts[1]

    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    model.zero_grad()
    reference = model(**whole).loss
    reference.backward()
    reference_grads = _grads(model)

    with torch.no_grad():  # what each rank's loss is worth: its token-loss sum over N / dp
        shares = [causal_lm_loss_terms(model(**b).logits, b["labels"])[0] / (total / 2) for b in batches]
    summed, values = None, []
    for rank, batch in enumerate(batches):
        other = 1 - rank
        weighting = TokenWeightedLoss(model, OtherRank([counts[other], shares[other]]), data_parallel_size=2)
        model.zero_grad()
        with weighting.training():
            loss = model(**batch).loss
        loss.backward()
        values.append(float(loss.detach()))
        grads = _grads(model)
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads)]

    # Every rank's value is the global token mean; the data-parallel average of the gradients is its gradient.
    assert max(abs(v - float(reference.detach())) for v in values) < 1e-6
    assert max(float((g / 2 - r).abs().max()) for g, r in zip(summed, reference_grads)) < 1e-6
    # Negative control: the mean of the per-rank means is a different number.
    with torch.no_grad():
        per_rank_means = [float(model(**b).loss) for b in batches]
    assert abs(sum(per_rank_means) / 2 - float(reference.detach())) > 1e-4


@torch.no_grad()
def test_user_normalisation_and_label_free_calls_are_left_alone():
    model = tiny_llama()
    batch = padded_batch([4, 9], prompt=1, seed=3)
    expected = float(model(**batch, num_items_in_batch=torch.tensor(7.0)).loss)
    never = OtherRank([])  # popping from it would raise: no collective may run
    with TokenWeightedLoss(model, never, data_parallel_size=2).training():
        assert float(model(**batch, num_items_in_batch=torch.tensor(7.0)).loss) == expected
        assert model(input_ids=batch["input_ids"]).loss is None
    # The hooks live only inside the block: afterwards transformers' own mean is back.
    assert float(model(**batch).loss) == float(model(**batch).loss)
    weighting = TokenWeightedLoss(model, OtherRank([torch.tensor(0.0), torch.tensor(0.0)]), 1)
    with weighting.training():
        weighted = float(model(**batch).loss)
    assert abs(weighted - float(model(**batch).loss)) < 1e-6


def test_a_causal_lm_whose_forward_cannot_take_the_count_is_refused_by_name():
    class Stubborn(nn.Module):
        loss_type = "ForCausalLM"

        def forward(self, input_ids, labels=None):
            return (input_ids.float().sum(),)

    module = Stubborn()
    ids = torch.ones(1, 3, dtype=torch.long)
    with TokenWeightedLoss(module, OtherRank([]), 2).training():
        with pytest.raises(ValueError, match="Stubborn.forward does not take num_items_in_batch.*causal_lm_loss_terms"):
            module(input_ids=ids, labels=ids)


def test_token_weighting_applies_to_causal_lms_under_data_parallelism_only():
    holder = nn.Module()
    holder.model = tiny_llama()
    assert adapt(holder).loss_weighting(None, data_parallel_size=1) is None
    assert adapt(nn.Linear(2, 2)).loss_weighting(None, data_parallel_size=2) is None
    assert isinstance(adapt(holder).loss_weighting(None, data_parallel_size=2), TokenWeightedLoss)
    with pytest.warns(UserWarning, match="accumulate_grad_batches=2 .* weigh equally"):
        adapt(holder).loss_weighting(None, data_parallel_size=2, accumulate_grad_batches=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adapt(holder).loss_weighting(None, data_parallel_size=2, accumulate_grad_batches=2, warn=False)
