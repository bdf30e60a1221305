"""Tied pipeline copies must be optimised alike on every holder, or they drift apart silently."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.tied import TiedCopies


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8, bias=False)


def _check(monkeypatch, my_decay, other_decay):
    """This rank (1) holds lm_head; rank 0 holds embed_tokens with ``other_decay``."""
    module = _Head()
    optimizer = torch.optim.AdamW([{"params": [module.lm_head.weight], "weight_decay": my_decay}], lr=1e-3)
    other = optimizer.param_groups[0] | {"weight_decay": other_decay}
    other_settings = f"AdamW {sorted((k, v) for k, v in other.items() if k != 'params')}"

    def all_gather_object(out, mine):
        out[:] = [{((0, 1), 0): ("model.embed_tokens.weight", other_settings)}, mine]

    monkeypatch.setattr(pipeline_tied.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(pipeline_tied.dist, "all_gather_object", all_gather_object)
    pipeline_tied.check_tied_optimizer_groups(module, [TiedCopies("lm_head.weight", (0, 1), 1)], [optimizer])


def test_copies_in_groups_with_the_same_settings_pass(monkeypatch):
    _check(monkeypatch, 0.0, 0.0)


def test_a_copy_that_decays_while_its_twin_does_not_is_refused_naming_both(monkeypatch):
    with pytest.raises(
        ValueError, match=r"'model.embed_tokens.weight' and 'lm_head.weight'.*weight_decay.*same param group"
    ):
        _check(monkeypatch, 0.1, 0.0)
