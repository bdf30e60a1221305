"""Pipeline plans of Hugging Face models and of users' own modules, checked in one process (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.adapters import adapt
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.compose import check_module
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.chain_check import run_chain
from lightning_parallel.parallel.pipeline.stages import split_module
from lightning_parallel.parallel.pipeline.tied import local_tied_copies

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
PP2 = (ParallelLayout(2, 1, 2, 1), ParallelOptions(1, 2, 1, microbatches=2, schedule="1f1b"))


class Holder(nn.Module):
    """A user's module: a Hugging Face model and nothing else."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def llama(**overrides) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**SHAPE, **overrides}))


class SkippingChain(nn.Module):
    """pipeline_layers() forgets a block forward runs: the chain does not compose to forward."""

    example_input_array = torch.ones(2, 4)

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def pipeline_layers(self) -> list:
        return [self.a, self.c]

    def pipeline_loss(self, output, target):
        return (output - target).pow(2).mean()

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def no_plan():
    return Holder(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64)))


def encoder_decoder():
    config = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=64)
    return Holder(transformers.T5ForConditionalGeneration(config))


def layer_count_mismatch():
    module = Holder(llama())
    module.model.config.num_hidden_layers = 1  # forward would run one decoder layer of the two
    return module


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            no_plan,
            r"GPT2LMHeadModel has no pipeline plan: config.base_model_pp_plan is missing.*define pipeline_layers",
        ),
        (encoder_decoder, r"T5ForConditionalGeneration is an encoder-decoder model.*define pipeline_layers"),
        (layer_count_mismatch, r"LlamaForCausalLM holds 2 decoder layers but config.num_hidden_layers=1"),
        (lambda: nn.Linear(2, 2), r"Linear cannot be split into pipeline stages: it defines no pipeline_layers"),
        (lambda: SkippingChain(), r"outside every pipeline layer"),
        (
            lambda: Holder(llama(tie_word_embeddings=True)),
            r"ties parameters across pipeline layers.*Fix: a loop schedule",
        ),
    ],
    ids=["no-pipeline-plan", "encoder-decoder", "layers-skipped-by-forward", "no-protocol-no-model", "orphan-block",
         "tie-on-one-rank-under-zero"],
)
def test_modules_that_cannot_be_pipelined_fail_before_any_process_group(build, message):
    layout, options = PP2
    if "tie" in message:  # a V schedule may hold both tied stages on one rank, which FSDP2 cannot shard as one
        layout, options = ParallelLayout(4, 2, 2, 1), ParallelOptions(2, 2, 1, zero_stage=2, microbatches=4,
                                                                      schedule="zbv", stages_per_rank=2)
    with pytest.raises(ValueError, match=message):
        check_module(build(), layout, options)


def test_a_layer_chain_that_does_not_compose_to_forward_is_refused():
    module = SkippingChain()
    module.b = nn.Identity()  # forward now runs a -> relu -> c; the chain runs a -> c
    with pytest.raises(ValueError, match=r"layer chain of SkippingChain \(from pipeline_layers\(\)\).*away from"):
        check_module(module, *PP2)
    module.forward = lambda x: module.c(module.a(x))
    check_module(module, *PP2)  # the same chain composing to forward passes


def test_the_chain_check_is_skipped_on_the_meta_device():
    with torch.device("meta"):
        module = Holder(llama())
    check_module(module, *PP2)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hugging_face_stages_rebuild_causal_and_padding_masks(attention):
    module = Holder(llama(attn_implementation=attention))
    plan = adapt(module).pipeline_plan()
    assert plan.names[0] == "model.model.embed_tokens" and plan.names[-1] == "model.lm_head"
    ids = torch.randint(3, 64, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    with torch.no_grad():
        chained = run_chain(
            list(zip(plan.names, plan.layers)), plan.make_stage, {"input_ids": ids, "attention_mask": mask}
        )
        assert torch.equal(chained, module.model(input_ids=ids, attention_mask=mask).logits)
        changed = ids.clone()
        changed[:, -1] = (ids[:, -1] + 1) % 64  # a later token must not change earlier logits (causal)
        later = run_chain(
            list(zip(plan.names, plan.layers)), plan.make_stage, {"input_ids": changed, "attention_mask": mask}
        )
    assert torch.equal(later[:, :-1], chained[:, :-1])


def test_a_hugging_face_batch_splits_into_inputs_and_labels():
    module = Holder(llama())
    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3),
        "labels": torch.zeros(2, 3),
    }
    inputs, targets = adapt(module).split_batch(batch)
    assert sorted(inputs) == ["attention_mask", "input_ids"] and targets is batch["labels"]
    with pytest.raises(ValueError, match="no 'labels'"):
        adapt(module).split_batch({"input_ids": batch["input_ids"]})
    stage = adapt(module).pipeline_plan().make_stage([])
    with pytest.raises(ValueError, match=r"Batch keys \['token_type_ids'\]"):
        stage.stage_arguments({**inputs, "token_type_ids": batch["input_ids"]})


def test_a_tied_embedding_and_head_split_over_two_ranks_keep_their_names_on_each():
    plans = {}
    for rank in (0, 1):
        module = Holder(llama(tie_word_embeddings=True))
        plan = adapt(module).pipeline_plan()
        split, _ = split_module(module, plan.layers, [0, 2, len(plan.layers)], [rank], plan.make_stage)
        stage_of = [split.stage_of(i) for i in range(len(split.names))]
        plans[rank] = (local_tied_copies(split.shared, stage_of, [0, 1], rank), set(module.state_dict()))
    assert [(c.name, c.ranks, c.is_first) for c in plans[0][0]] == [("model.model.embed_tokens.weight", (0, 1), True)]
    assert [(c.name, c.ranks, c.is_first) for c in plans[1][0]] == [("model.lm_head.weight", (0, 1), False)]
    assert "model.lm_head.weight" not in plans[0][1] and "model.model.embed_tokens.weight" not in plans[1][1]


def test_a_tie_within_one_rank_stays_one_parameter():
    module = Holder(llama(tie_word_embeddings=True))
    plan = adapt(module).pipeline_plan()
    split, _ = split_module(module, plan.layers, [0, 2, len(plan.layers)], [0, 1], plan.make_stage)
    stage_of = [split.stage_of(i) for i in range(len(split.names))]
    assert local_tied_copies(split.shared, stage_of, [0, 0], 0) == []
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight


def test_a_sliding_window_is_mirrored_and_a_wrong_mask_is_caught_by_the_chain_check(monkeypatch):
    from lightning_parallel.adapters.hf import pipeline as hf_pipeline

    config = transformers.MistralConfig(**SHAPE, sliding_window=4)  # shorter than the check's rows of 8 tokens
    torch.manual_seed(0)
    module = Holder(transformers.AutoModelForCausalLM.from_config(config))
    check_module(module, *PP2)
    monkeypatch.setattr(hf_pipeline, "attention_types", lambda model: ["full_attention"] * 2)
    with pytest.raises(ValueError, match="pipeline plan of MistralForCausalLM"):
        check_module(module, *PP2)
