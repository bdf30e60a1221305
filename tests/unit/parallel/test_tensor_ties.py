"""Tied weights under tensor parallelism: checked before sharding, restored after (no processes)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.tensor.plan import concrete_plan
from lightning_parallel.parallel.tensor.ties import check_ties, restore_ties, tie_groups, weight_placement


class TiedLM(nn.Module):
    """An embedding and a head sharing one (vocab, width) weight."""

    def __init__(self, vocab: int = 16, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight


def test_tie_groups_names_every_shared_parameter():
    assert tie_groups(TiedLM()) == [["embed.weight", "head.weight"]]
    assert tie_groups(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


@pytest.mark.parametrize(
    ("style", "module", "placement"),
    [
        (RowwiseParallel(), nn.Embedding(4, 2), "Shard(dim=0)"),  # vocabulary rows
        (ColwiseParallel(), nn.Linear(2, 4), "Shard(dim=0)"),  # output rows of the (out, in) weight
        (ColwiseParallel(), nn.Embedding(4, 2), "Shard(dim=1)"),
        (RowwiseParallel(), nn.Linear(2, 4), "Shard(dim=1)"),
        (SequenceParallel(), nn.LayerNorm(2), "Replicate()"),
        (None, nn.Linear(2, 4), "unsharded"),
    ],
)
def test_weight_placement_of_each_style(style, module, placement):
    assert weight_placement(style, module) == placement


def test_vocabulary_sharded_embedding_and_column_sharded_head_keep_the_tie():
    model = TiedLM()
    plan = {"embed": "embedding_rowwise", "head": "colwise_gather"}
    check_ties(model, concrete_plan(model, plan, adapter=adapt(model)))


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"head": "colwise_gather"},
            r"embed\.weight: unsharded \(plan 'embed': not in the plan\); head\.weight: Shard\(dim=0\)",
        ),
        ({"embed": "colwise", "head": "colwise"}, r"embed\.weight: Shard\(dim=1\).*head\.weight: Shard\(dim=0\)"),
    ],
)
def test_a_plan_that_would_untie_is_refused(plan, message):
    model = TiedLM()
    with pytest.raises(ValueError, match=rf"embed\.weight and head\.weight are one tied parameter.*{message}"):
        check_ties(model, concrete_plan(model, plan, adapter=adapt(model)))


def test_restore_ties_points_every_name_at_one_parameter():
    model = TiedLM()
    groups = tie_groups(model)
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())  # what sharding one owner does
    restore_ties(model, groups)
    assert model.head.weight is model.embed.weight and len(list(model.parameters())) == 1
    model.head.weight = nn.Parameter(torch.zeros(8, 16))  # cannot be one tensor again
    with pytest.raises(ValueError, match="untied embed.weight and head.weight"):
        restore_ties(model, groups)
