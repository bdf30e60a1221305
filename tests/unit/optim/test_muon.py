"""MuonWithAdamW on one process: its Muon groups step exactly as torch.optim.Muon, its other groups exactly as
torch.optim.AdamW, its state round-trips through state_dict, and it refuses a non-matrix in a Muon group."""

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.optim import MuonWithAdamW, muon_groups
from lightning_parallel.optim.orthogonalize import newton_schulz


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 5))


def _steps(model, optimizer, steps=4):
    torch.manual_seed(1)
    for _ in range(steps):
        optimizer.zero_grad()
        out = model[3](model[2](model[1](model[0](torch.randint(0, 16, (6,))))))
        out.square().mean().backward()
        optimizer.step()


def test_muon_groups_step_as_torch_muon_and_the_rest_as_torch_adamw():
    ours, theirs = _model(), _model()
    groups = muon_groups(ours, weight_decay=0.1, exclude=lambda name: name.startswith("3."))
    assert [len(g["params"]) for g in groups] == [1, 2, 4]  # Linear 1; embedding + head; biases and norm
    optimizer = MuonWithAdamW(groups, lr=0.02, adamw_lr=3e-3)
    muon_params = [theirs[1].weight]
    adam_decay = [theirs[0].weight, theirs[3].weight]
    adam_plain = [theirs[1].bias, theirs[2].weight, theirs[2].bias, theirs[3].bias]
    muon = torch.optim.Muon(muon_params, lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW([{"params": adam_decay, "weight_decay": 0.1}, {"params": adam_plain,
                                                                           "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95))

    class Both:
        def zero_grad(self):
            muon.zero_grad()
            adamw.zero_grad()

        def step(self):
            muon.step()
            adamw.step()

    _steps(ours, optimizer)
    _steps(theirs, Both())
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


def test_the_iteration_is_torch_muons_and_matrices_of_a_stack_are_orthogonalised_one_by_one():
    torch.manual_seed(0)
    stack = torch.randn(3, 6, 4)
    ours = newton_schulz(stack, (3.4445, -4.775, 2.0315), 5, 1e-7)
    for i in range(3):
        assert torch.equal(ours[i], newton_schulz(stack[i], (3.4445, -4.775, 2.0315), 5, 1e-7))


def test_state_round_trips_and_a_vector_in_a_muon_group_is_refused():
    def make(model):
        return MuonWithAdamW(muon_groups(model, exclude=lambda name: name.startswith("3.")))

    model = _model()
    optimizer = make(model)
    _steps(model, optimizer, 2)
    twin = copy.deepcopy(model)
    restored = make(twin)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _steps(model, optimizer, 1)
    _steps(twin, restored, 1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert set(optimizer.state[model[1].weight]) == {"momentum_buffer"}
    assert set(optimizer.state[model[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="put vectors, norms and biases in an AdamW group"):
        MuonWithAdamW([{"params": [model[2].weight], "use_muon": True}])
