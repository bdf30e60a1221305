"""A Hugging Face MoE model's router balancing loss made global over data-parallel ranks, checked in one process.

Two "ranks" are the halves of one batch; the sum over ranks is a stand-in that adds the other half's statistics.
Each half's balancing term must take the whole batch's value (transformers' own ``aux_loss`` on it), and the
average of the halves' gradients must be the whole batch's gradient. Splits the suite cannot make exact stay
refused before start.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters.hf.router_loss import (  # noqa: E402
    GlobalRouterLoss,
    check_router_loss_split,
    routing_statistics,
)
from lightning_parallel.layout import ParallelLayout  # noqa: E402
from lightning_parallel.parallel.compose import check_module  # noqa: E402
from lightning_parallel.parallel.options import ParallelOptions  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, output_router_logits=True)
FAMILIES = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
}


def _model(family: str, **overrides):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **{**SMALL, **FAMILIES[family], **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (4, 12), generator=gen)
    mask = (torch.arange(12) < torch.tensor([[12], [5], [9], [3]])).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _half(batch, part: int):
    return {key: value[2 * part: 2 * part + 2] for key, value in batch.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_statistics_give_the_models_own_balancing_loss(family):
    model, batch = _model(family), _batch()
    out = model(**batch)
    counts, probs, rows = routing_statistics(out.router_logits, 4, 2, batch["attention_mask"])
    assert float(rows) == 2 * batch["attention_mask"].sum()  # two MoE layers
    assert abs((4 * torch.sum(counts / rows * probs / rows)).item() - out.aux_loss.item()) < 1e-6


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_half_gets_the_whole_batchs_term_and_the_averaged_gradient(family):
    model, batch = _model(family), _batch()
    whole = model(**batch)
    router = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    whole_grads = torch.autograd.grad(whole.aux_loss, router)
    with torch.no_grad():
        stats = [torch.cat([t.reshape(-1) for t in routing_statistics(model(**_half(batch, part)).router_logits, 4,
                                                                      2, _half(batch, part)["attention_mask"])])
                 for part in (0, 1)]
    grads = []
    for part in (0, 1):
        hook = GlobalRouterLoss(model, lambda t, other=stats[1 - part]: t + other, data_parallel_size=2)
        with hook.training():
            out = model(**_half(batch, part))
        assert abs(out.aux_loss.item() - whole.aux_loss.item()) < 1e-6
        local = model(**_half(batch, part))  # without the hook: the half's own term and causal-LM loss
        coef = model.router_aux_loss_coef
        expected = local.loss.item() - coef * local.aux_loss.item() + coef * whole.aux_loss.item()
        assert abs(out.loss.item() - expected) < 1e-6
        grads.append(torch.autograd.grad(out.aux_loss, router))
    for mean, reference in zip([(a + b) / 2 for a, b in zip(*grads)], whole_grads):
        assert (mean - reference).abs().max() < 1e-6


def test_a_different_formula_is_stopped_rather_than_trained_on():
    model, batch = _model("mixtral"), _batch()

    def other_formula(module, args, output):  # a family whose balancing term is formed differently
        output.aux_loss = output.aux_loss * 2
        return output

    model.register_forward_hook(other_formula)  # runs before the suite's hook
    hook = GlobalRouterLoss(model, lambda t: t, data_parallel_size=1)
    with hook.training(), pytest.raises(ValueError, match="is not the formula the suite makes global"):
        model(**batch)


class MoELM(pl.LightningModule):
    def __init__(self, family: str) -> None:
        super().__init__()
        config = transformers.AutoConfig.for_model(family, **SMALL, **FAMILIES.get(family, {}))
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("sizes", [dict(data_parallel=2), dict(data_parallel=2, expert_parallel=2),
                                   dict(data_parallel=1, tensor_parallel=2)], ids=["dp2", "dp2/ep2", "tp2"])
def test_data_and_expert_splits_of_a_checked_family_are_allowed(sizes):
    check_module(MoELM("qwen3_moe"), ParallelLayout.resolve(2, **sizes), ParallelOptions())


@pytest.mark.parametrize("sizes", [dict(pipeline_parallel=2, data_parallel=1),
                                   dict(data_parallel=1, context_parallel=2)], ids=["pp2", "cp2"])
def test_context_splits_and_pipelines_other_than_gpipe_stay_refused(sizes):
    """Under pipeline 2 the default schedule (1f1b) runs a backward before the step's routing is known."""
    layout = ParallelLayout.resolve(2, **sizes)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*Set output_router_logits=False") as error:
        check_module(MoELM("mixtral"), layout, ParallelOptions(context_parallel_size=layout.context_parallel))
    split = "pipeline_parallel_size=2 (schedule='1f1b')" if "pipeline_parallel" in sizes else "context_parallel_size=2"
    assert split in str(error.value) and "schedule='gpipe'" in str(error.value)  # the remedy names it


def test_a_gpipe_pipeline_split_is_accepted():
    splits = ["data_parallel_size=2", "pipeline_parallel_size=2 (schedule='gpipe')"]
    check_router_loss_split(MoELM("mixtral").model, splits)


def test_a_family_the_suite_does_not_make_global_stays_refused_under_data_parallelism():
    config = transformers.AutoConfig.for_model("granitemoe", **SMALL, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"granitemoe's is not one the suite makes global: Mixtral"):
        check_router_loss_split(model, ["data_parallel_size=2"])
