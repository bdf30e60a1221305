"""The parts the recipes share: the transformer block (causal or not) and the optimizer set-up."""

import math

import pytest
import torch
from torch import nn

from examples.optimization import warmup_cosine, weight_decay_groups, with_warmup_cosine
from examples.transformer import Block


@pytest.mark.parametrize("causal", [True, False])
def test_block_sees_later_tokens_only_when_bidirectional(causal):
    torch.manual_seed(0)
    block = Block(d_model=8, n_head=2, mlp_ratio=2, dropout=0.0, causal=causal).eval()
    x = torch.randn(1, 5, 8)
    changed = x.clone()
    changed[:, -1] = torch.randn(8)  # only the last token differs
    earlier_moved = not torch.allclose(block(x)[:, :-1], block(changed)[:, :-1])
    assert earlier_moved is not causal


def test_block_parameter_names_are_what_the_tensor_plans_name():
    names = {name for name, _ in Block(d_model=8, n_head=2, mlp_ratio=2, dropout=0.0, causal=True).named_parameters()}
    assert {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.out.weight", "mlp.up.weight", "mlp.down.weight",
            "ln1.weight", "ln2.weight"} <= names


def test_weight_decay_groups_decay_matrices_but_not_vectors_or_exempt_names():
    model = nn.ModuleDict({"embed": nn.Embedding(4, 3), "proj": nn.Linear(3, 2), "norm": nn.LayerNorm(2)})
    decay, no_decay = weight_decay_groups(model, 0.1, exempt=lambda name: "embed" in name)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [(2, 3)]
    assert len(no_decay["params"]) == 4  # embedding table, linear bias, norm weight and bias


def test_weight_decay_groups_drop_an_empty_group():
    (only,) = weight_decay_groups(nn.LayerNorm(3), 0.1)  # a pipeline stage may hold no matrix
    assert only["weight_decay"] == 0.0


def test_warmup_cosine_warms_up_linearly_then_decays_to_the_floor():
    assert [warmup_cosine(s, 4, 10) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(warmup_cosine(4, 4, 10), 1.0) and math.isclose(warmup_cosine(10, 4, 10), 0.1)
    assert warmup_cosine(50, 0, 0) == 1.0  # max_steps=0: flat


def test_with_warmup_cosine_steps_the_schedule_every_optimizer_step():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    config = with_warmup_cosine(optimizer, warmup_steps=2, max_steps=4)
    assert config["optimizer"] is optimizer and config["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["lr"] == 0.5
