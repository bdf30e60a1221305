"""Pipeline stages of Hugging Face families whose forward does more than run the plan's blocks (issue 29).

In one process, no process group: the stages' chain (every pipeline layer in one stage module, as the
split will run them) must give ``forward``'s logits on a padded batch, for decoders that scale their
embeddings or logits (Granite, Cohere, Gemma 2's soft-capping), name their own blocks (GPT-NeoX), or rotate
with one base per layer type (Gemma 3); and a forward doing anything else around its blocks is refused
before any process starts, naming the statement.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.adapters import adapt
from lightning_parallel.adapters.hf.chain import read_chain
from lightning_parallel.adapters.hf.pipeline import describe_blocks
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.compose import check_module
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.chain_check import run_chain

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)
PP2 = (ParallelLayout(2, 1, 2, 1), ParallelOptions(1, 2, 1, microbatches=2, schedule="1f1b"))


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def build(family: str, **overrides) -> Holder:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**SHAPE, **overrides})
    return Holder(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def chain_and_forward(module: Holder) -> tuple[torch.Tensor, torch.Tensor]:
    plan = adapt(module).pipeline_plan()
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad():
        chained = run_chain(list(zip(plan.names, plan.layers)), plan.make_stage, {"input_ids": ids,
                                                                                    "attention_mask": mask})
        return chained, module.model(input_ids=ids, attention_mask=mask).logits


SCALED = {  # family -> (config overrides, the steps the chain must apply, in order: (where, kind, value))
    "granite": ({"embedding_multiplier": 12.0, "logits_scaling": 8.0},
                [("embed", "mul", 12.0), ("after_head", "div", 8.0)]),
    "cohere": ({"logit_scale": 0.0625}, [("after_head", "mul", 0.0625)]),
    "gemma2": ({"final_logit_softcapping": 3.0},
               [("after_head", "div", 3.0), ("after_head", "tanh", 1.0), ("after_head", "mul", 3.0)]),
}


@pytest.mark.parametrize("family", sorted(SCALED))
def test_scalars_around_the_block_chain_are_applied_where_forward_applies_them(family):
    overrides, steps = SCALED[family]
    module = build(family, **overrides)
    blocks = describe_blocks(module.model)
    read = [(where, op.kind, op.value) for where in ("embed", "before_head", "after_head")
            for op in getattr(blocks.chain, where)]
    assert read == steps
    chained, logits = chain_and_forward(module)
    assert torch.allclose(chained, logits, atol=1e-6, rtol=0), (chained - logits).abs().max()
    check_module(module, *PP2)  # the suite's own chain check agrees, before any process starts


def test_granite_without_its_scalars_would_be_refused_by_the_chain_check(monkeypatch):
    """The negative control: the chain without the steps is 1.3+ off forward (the issue's refusal)."""
    from lightning_parallel.adapters.hf import pipeline as hf_pipeline

    module = build("granite", embedding_multiplier=12.0, logits_scaling=8.0)
    chained, logits = chain_and_forward(module)
    assert torch.allclose(chained, logits, atol=1e-6)
    monkeypatch.setattr(hf_pipeline, "read_chain", lambda *args: type(read_chain(module.model, set(), "", set()))())
    with pytest.raises(ValueError, match=r"layer chain of Holder .* away from forward's"):
        check_module(module, *PP2)


def test_a_pipeline_plan_naming_its_own_blocks_is_followed():
    module = build("gpt_neox", rotary_pct=0.5)
    blocks = describe_blocks(module.model)
    assert blocks.roles == {"embed_in": "embed", "emb_dropout": "hidden", "layers": "decoder",
                            "final_layer_norm": "hidden"}
    plan = adapt(module).pipeline_plan()
    assert plan.names == ("model.gpt_neox.embed_in", "model.gpt_neox.emb_dropout", "model.gpt_neox.layers.0",
                          "model.gpt_neox.layers.1", "model.gpt_neox.final_layer_norm", "model.lm_head")
    chained, logits = chain_and_forward(module)
    assert torch.equal(chained, logits)
    check_module(module, *PP2)


def test_rotary_positions_per_layer_type_are_rebuilt_on_each_stage():
    module = build("gemma3_text", layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                   final_logit_softcapping=5.0)
    rope = module.model.config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]  # two bases
    chained, logits = chain_and_forward(module)
    assert torch.allclose(chained, logits, atol=1e-6, rtol=0)
    plan = adapt(module).pipeline_plan()
    stage = plan.make_stage([(plan.names[1], plan.layers[1])])  # the first decoder layer alone
    assert stage.by_type and stage.rotary_emb is module.model.model.rotary_emb
    assert not hasattr(plan.make_stage([(plan.names[0], plan.layers[0])]), "rotary_emb")  # the embedding alone
    check_module(module, *PP2)


class ExtraStep(transformers.LlamaForCausalLM):
    """A decoder whose forward shifts its logits by a learned offset: nothing the stages know how to do."""

    def __init__(self, config):
        super().__init__(config)
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = logits + self.offset
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)


def test_anything_else_around_the_blocks_is_refused_naming_the_statement():
    torch.manual_seed(0)
    module = Holder(ExtraStep(transformers.LlamaConfig(**SHAPE)))
    with pytest.raises(ValueError, match=r"ExtraStep's forward does more .*'logits = logits \+ self.offset'"):
        check_module(module, *PP2)


def test_a_plan_block_the_base_model_does_not_hold_is_a_value_error():
    module = build("llama")
    module.model.config.base_model_pp_plan = {**module.model.config.base_model_pp_plan, "missing": (["x"], ["y"])}
    with pytest.raises(ValueError, match=r"pipeline plan names 'missing', which its base model does not hold"):
        check_module(module, *PP2)
