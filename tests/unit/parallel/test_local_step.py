"""``step_on_local_shards``: element-wise optimizers step on the local tensors of DTensor parameters, with the
numbers of the DTensor path, DTensor state outside the step, and nothing else switched."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallel.local_step import step_on_local_shards


def _sharded(world_of_one) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    _, mesh = world_of_one
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    fully_shard(model, mesh=mesh.mesh("data_parallel"))
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)

        def closure():
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        losses.append(float(optimizer.step(closure).detach()))
    return losses


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
                                  lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)], ids=["adamw", "sgd"])
def test_the_local_step_gives_the_dtensor_steps_numbers_and_keeps_dtensor_state(world_of_one, make):
    from torch.distributed.tensor import DTensor

    plain_model, local_model = _sharded(world_of_one), _sharded(world_of_one)  # the same seed
    plain, local = make(plain_model.parameters()), make(local_model.parameters())
    assert step_on_local_shards([local]) == [local]
    assert _train(local_model, local) == _train(plain_model, plain)
    for p, q in zip(local_model.parameters(), plain_model.parameters()):
        assert isinstance(p, DTensor) and torch.equal(p.to_local(), q.to_local())
        assert set(local.state[p]) == set(plain.state[q])
        for key, value in local.state[p].items():
            assert type(value) is type(plain.state[q][key]), key
    assert all(group["params"][0] is p for group, p in zip(local.param_groups, local_model.parameters()))
    restored = make(local_model.parameters())
    restored.load_state_dict(local.state_dict())  # the state dict is the DTensor path's


def test_only_element_wise_optimizers_over_dtensors_are_switched_and_only_once(world_of_one):
    model = _sharded(world_of_one)
    adam = torch.optim.Adam(model.parameters())
    assert step_on_local_shards([adam]) == [adam] and step_on_local_shards([adam]) == []
    lbfgs = torch.optim.LBFGS(model.parameters())  # reads the whole parameter vector: stays on DTensors
    plain = torch.optim.Adam(nn.Linear(2, 2).parameters())  # nothing to switch
    assert step_on_local_shards([lbfgs, plain]) == []


def test_a_learning_rate_scheduler_made_before_the_switch_sees_its_own_step_order(world_of_one):
    """Lightning builds schedulers in ``configure_optimizers``, before the strategy switches the step: torch's
    scheduler must neither warn that the step was overridden nor that it stepped before the optimizer."""
    import warnings

    model = _sharded(world_of_one)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    step_on_local_shards([optimizer])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, optimizer, steps=1)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
