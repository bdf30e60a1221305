"""The Hugging Face half of context parallelism without processes: the batch split, the mask descriptor, the
refusals before a run, and the errors a wrongly called model raises before any rank communicates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.adapters.hf.context import (  # noqa: E402
    apply_hf_context,
    check_hf_context,
    context_attention_function,
    descriptor,
    read_descriptor,
    shifted_labels,
    split_hf_batch,
)
from lightning_parallel.adapters.hf.loss import valid_count  # noqa: E402
from lightning_parallel.parallel.context.plan import ContextGroup  # noqa: E402

VOCAB, SEQ, CP = 64, 16, 2
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)


def llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, **overrides}))


def group(rank: int, method: str = "ring") -> ContextGroup:
    return ContextGroup(None, CP, rank, method)


def padded_batch() -> dict[str, torch.Tensor]:
    ids = torch.arange(1, 2 * SEQ + 1).reshape(2, SEQ) % VOCAB
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, 10:] = 0  # right padding
    mask[1, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


# The split -----------------------------------------------------------------------------------
def test_shift_labels_carry_the_next_token_across_chunk_boundaries():
    batch, model = padded_batch(), llama()
    labels = batch["labels"]
    shares = [split_hf_batch(batch, group(r), model) for r in range(CP)]
    # Chunks of S / (2 cp) = 4: rank 0 holds positions 0-3 and 12-15, rank 1 holds 4-7 and 8-11.
    assert torch.equal(shares[0]["shift_labels"][:, 3], labels[:, 4])  # its next token lives on rank 1
    assert torch.equal(shares[1]["shift_labels"][:, 3], labels[:, 8])  # the next token is in its other chunk
    assert torch.equal(shares[1]["shift_labels"][:, 7], labels[:, 12])  # ... and back on rank 0
    assert (shares[0]["shift_labels"][:, 7] == -100).all()  # the sequence's last token predicts nothing
    # Every rank's shift_labels together are the whole sequence's, which transformers would compute in one process.
    whole = torch.full_like(labels, -200)
    for rank, share in enumerate(shares):
        whole[:, group(rank).positions(SEQ)] = share["shift_labels"]
    assert torch.equal(whole, shifted_labels(labels))
    assert torch.equal(whole[:, :-1], labels[:, 1:])
    assert torch.equal(shares[0]["input_ids"], batch["input_ids"][:, [0, 1, 2, 3, 12, 13, 14, 15]])
    assert torch.equal(shares[1]["labels"], labels[:, [4, 5, 6, 7, 8, 9, 10, 11]])


def test_position_ids_are_global_positions_or_the_share_of_the_given_ones():
    batch, model = padded_batch(), llama()
    share = split_hf_batch(batch, group(1), model)
    assert torch.equal(share["position_ids"], torch.tensor([[4, 5, 6, 7, 8, 9, 10, 11]] * 2))
    given = {**batch, "position_ids": torch.arange(SEQ).flip(0)[None].expand(2, -1)}
    reversed_share = split_hf_batch(given, group(0), model)["position_ids"][0]
    assert torch.equal(reversed_share, torch.tensor([15, 14, 13, 12, 3, 2, 1, 0]))


def test_the_descriptor_carries_the_padding_of_the_whole_sequence():
    batch, model = padded_batch(), llama()
    mask = split_hf_batch(batch, group(1), model)["attention_mask"]
    assert mask.shape == (2, 1, 1, SEQ) and mask.dtype == torch.int64  # the whole sequence on every rank
    expected = torch.zeros(2, SEQ, dtype=torch.int64)
    expected[0, 10:] = -1
    expected[1, :3] = -1
    assert torch.equal(read_descriptor(mask), expected)


def _documents(batch, model):
    return read_descriptor(split_hf_batch(batch, group(0), model)["attention_mask"])


def test_packed_documents_only_where_transformers_separates_them():
    ids = torch.arange(SEQ)[None] + 1
    positions = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])[None]
    packed = {"input_ids": ids, "position_ids": positions, "labels": ids}
    no_cache = llama(use_cache=False)
    assert torch.equal(_documents(packed, no_cache), torch.tensor([[0] * 5 + [1] * 7 + [2] * 4]))
    two_rows = {**packed, "input_ids": ids.expand(2, -1), "labels": ids.expand(2, -1)}  # [1, S] ids are expanded
    assert torch.equal(_documents(two_rows, no_cache), torch.tensor([[0] * 5 + [1] * 7 + [2] * 4] * 2))
    # With a key/value cache (the config's default) transformers skips packing detection: one document.
    assert _documents(packed, llama()) is None
    assert _documents({**packed, "use_cache": True}, no_cache) is None
    # With a 2-D mask transformers masks its padding only, whatever the position ids say.
    masked = {**packed, "attention_mask": torch.ones(1, SEQ, dtype=torch.long)}
    assert _documents(masked, no_cache) is None
    masked["attention_mask"][0, -2:] = 0
    assert torch.equal(_documents(masked, no_cache), torch.tensor([[0] * 14 + [-1] * 2]))
    # Neither: one document, no padding -- the plain descriptor, told apart by its shape alone.
    plain = split_hf_batch({"input_ids": ids, "labels": ids}, group(0), no_cache)["attention_mask"]
    assert plain.shape == (1, 0, 1, SEQ) and read_descriptor(plain) is None


def test_descriptor_round_trip():
    documents = torch.tensor([[0, 0, 1, -1]])
    assert torch.equal(read_descriptor(descriptor(documents, 1, 4)), documents)
    assert read_descriptor(descriptor(None, 3, 4)) is None


def test_split_refuses_what_it_cannot_split():
    model = llama()
    with pytest.raises(ValueError, match="multiples of 4"):
        split_hf_batch({"input_ids": torch.ones(1, 10, dtype=torch.long)}, group(0), model)
    with pytest.raises(ValueError, match="must be dicts"):
        split_hf_batch((torch.ones(1, SEQ), torch.ones(1, SEQ)), group(0), model)
    with pytest.raises(ValueError, match="2-D padding mask"):
        split_hf_batch({"input_ids": torch.ones(1, SEQ, dtype=torch.long),
                        "attention_mask": torch.ones(1, 1, SEQ, SEQ)}, group(0), model)


def test_valid_count_reads_shift_labels_when_given():
    labels = torch.tensor([[1, 2, -100, 4]])
    assert int(valid_count(labels)) == 2  # shifted: 2, -100, 4
    assert int(valid_count(labels, torch.tensor([[-100, -100, 7, 8]]))) == 2


# Errors of a wrongly called model --------------------------------------------------------------
def test_a_forward_without_the_split_batch_is_refused():
    model = llama()
    apply_hf_context(model, group(0))
    share = split_hf_batch(padded_batch(), group(0), model)
    with pytest.raises(ValueError, match=r"shift_labels.*self\.model\(\*\*batch\)"):
        model(input_ids=share["input_ids"], attention_mask=share["attention_mask"], labels=share["labels"])
    with pytest.raises(ValueError, match=r"shape \(2, 8\).*self\.model\(\*\*batch\)"):
        model(**{**share, "attention_mask": padded_batch()["attention_mask"][:, :8]})
    with pytest.raises(ValueError, match="no attention_mask"):
        model(**{k: v for k, v in share.items() if k != "attention_mask"})


def test_the_model_switches_to_a_run_attention_function_of_its_own():
    first, second = llama(), llama()
    apply_hf_context(first, group(0))
    apply_hf_context(second, group(1, "ulysses"))
    names = {first.config._attn_implementation, second.config._attn_implementation}
    assert len(names) == 2 and all(n.startswith("lightning_parallel_context_") for n in names)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert not names & set(ALL_MASK_ATTENTION_FUNCTIONS)  # so the mask builders pass the descriptor through


def test_the_attention_function_refuses_arguments_it_cannot_compute():
    attention = context_attention_function(group(0))
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="s_aux"):
        attention(nn.Module(), q, q, q, descriptor(None, 1, SEQ), s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="dropout"):
        attention(nn.Module(), q, q, q, descriptor(None, 1, SEQ), dropout=0.1)


# Refusals before a run -----------------------------------------------------------------------
def _meta(config_class, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config_class(**kwargs))


def test_check_refuses_attention_dropout_and_heads_ulysses_cannot_split():
    with pytest.raises(ValueError, match="attention_dropout=0"):
        check_hf_context(llama(attention_dropout=0.1), "ring", 2)
    check_hf_context(llama(), "ulysses", 2)
    check_hf_context(llama(), "ulysses", 2, tensor_size=2)  # 2 query heads per tensor rank, 1 key/value head
    with pytest.raises(ValueError, match="context_parallel_method='ring'"):
        check_hf_context(llama(), "ulysses", 4, tensor_size=2)
    check_hf_context(llama(), "ring", 4, tensor_size=2)  # ring has no head constraint


def test_check_refuses_sinks_layer_types_and_encoder_decoders():
    sinks = _meta(transformers.GptOssConfig, vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2)
    with pytest.raises(ValueError, match="attention sinks"):
        check_hf_context(sinks, "ring", 2)
    qwen = _meta(transformers.Qwen2Config, **SMALL)
    qwen.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        check_hf_context(qwen, "ring", 2)
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32,
                                                                           num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="decoder-only causal LM"):
        check_hf_context(t5, "ring", 2)


def test_the_adapter_answers_for_the_model_and_the_module_plan_wins():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama(attention_dropout=0.1)

    with pytest.raises(ValueError, match="attention_dropout"):
        adapt(Holder()).check_context_parallel("ring", 2)

    class Planned(Holder):
        def context_parallel_plan(self):
            return {"model.model.layers.*.self_attn": "attention"}

    adapt(Planned()).check_context_parallel("ring", 2)  # the module's plan is asked, not the model's config


def test_a_pipeline_takes_the_shift_labels_as_targets_and_does_not_shift_them_again():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

    adapter = adapt(Holder())
    plan = adapter.pipeline_plan()  # made before context parallelism is applied, as the strategy does
    adapter.apply_context_parallel(adapter.module, group(0))
    share = split_hf_batch(padded_batch(), group(0), adapter.model)
    inputs, targets = adapter.split_batch(share)
    assert targets is share["shift_labels"] and sorted(inputs) == ["attention_mask", "input_ids", "position_ids"]
    logits = torch.randn(2, SEQ // CP, VOCAB)
    total, count = plan.loss_fn(logits, targets)
    expected = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    assert torch.allclose(total, expected) and int(count) == int((targets != -100).sum())
    assert int(plan.count_items(targets)) == int(count)


def test_check_refuses_dropout_outside_attention_naming_each_key():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("starcoder2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                  residual_dropout=0.1, embedding_dropout=0.0, attention_dropout=0.0)
    with pytest.raises(ValueError, match=r"config\.residual_dropout=0 for context parallelism"):
        check_hf_context(AutoModelForCausalLM.from_config(config), "ring", 2)
