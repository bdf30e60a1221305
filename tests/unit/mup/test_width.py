"""μP's arithmetic and its optimizer groups (lightning_parallel/mup/width.py, groups.py)."""

import math
from functools import partial

import pytest
import torch
from torch import nn

from lightning_parallel.mup import MupWidth, mup_optimizer


def test_every_factor_is_one_at_the_base_width_and_follows_the_width_ratio_elsewhere():
    assert MupWidth(64, 64).hidden_lr_factor == MupWidth(64, 64).output_multiplier == 1.0
    assert MupWidth(64, 64).attention_scale(16) == 16**-0.5  # the standard parametrisation, exactly
    wide = MupWidth(512, 64)
    assert (wide.multiplier, wide.hidden_lr_factor, wide.output_multiplier) == (8.0, 0.125, 0.125)
    assert wide.hidden_init_factor == pytest.approx(math.sqrt(1 / 8))
    # Heads widen with the model (count fixed): d_head 16 at the base, 128 here; the scale is sqrt(16) / 128 = 1/d_head
    # up to the base model's constant sqrt(16).
    assert wide.attention_scale(128) == pytest.approx(math.sqrt(16) / 128)


@pytest.mark.parametrize("base", [0, -8, 8.5, True, None])
def test_a_base_width_that_is_not_a_positive_integer_names_model_base_width(base):
    with pytest.raises(ValueError, match=r"model\.base_width=.* must be a positive integer"):
        MupWidth(64, base)


def test_hidden_parameters_get_groups_of_their_own_at_mup_lr_and_decay_the_rest_keep_theirs():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    roles = {"0.weight": "input", "1.weight": "hidden", "1.bias": "vector", "2.weight": "vector", "2.bias": "vector"}
    groups = [{"params": [model[0].weight, model[1].weight], "weight_decay": 0.1},
              {"params": [model[1].bias, *model[2].parameters()], "weight_decay": 0.0}]
    optimizer = mup_optimizer(partial(torch.optim.AdamW, lr=1e-3), groups, model, lambda name, p: roles[name],
                              MupWidth(32, 8))
    by_param = {id(p): (g["mup"], g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    assert by_param[id(model[1].weight)] == ("hidden", pytest.approx(2.5e-4), pytest.approx(0.4))
    assert by_param[id(model[0].weight)] == ("base", 1e-3, 0.1)
    assert by_param[id(model[2].weight)] == ("base", 1e-3, 0.0) and len(by_param) == 5


def test_an_optimizer_outside_the_adam_family_or_an_unknown_role_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Adam-family.*not torch.optim.sgd.SGD.*model.optimizer._target_"):
        mup_optimizer(partial(torch.optim.SGD, lr=1.0), [{"params": list(model.parameters())}], model,
                      lambda n, p: "hidden", MupWidth(4, 2))
    with pytest.raises(ValueError, match=r"weight: role 'matrix' is not one of"):
        mup_optimizer(torch.optim.AdamW, [{"params": list(model.parameters())}], model, lambda n, p: "matrix",
                      MupWidth(4, 2))
