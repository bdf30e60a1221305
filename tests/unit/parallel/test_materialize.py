"""Materialising a meta-built model: values from (seed, module name) alone, ties kept, bad models refused early."""

import pytest
import torch
from torch import nn

from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import BuildSettings, parallelize
from lightning_parallel.parallel.materialize import Materialization, materialize, plan_initialisation
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.protocol import layer_seed, seeded_init


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_values_depend_on_seed_and_names_only_and_ties_survive():
    with torch.device("meta"):
        module = Tied()
    plan = plan_initialisation(module, seed=7)
    materialize(module, torch.device("cpu"), plan)
    assert module.head.weight is module.embed.weight  # to_empty alone would give the head its own tensor
    eager = Tied()
    seeded_init(eager, seed=7)
    for (name, value), (_, expected) in zip(module.state_dict().items(), eager.state_dict().items()):
        assert torch.equal(value, expected), name
    with torch.random.fork_rng():
        torch.manual_seed(layer_seed(7, "body"))
        assert torch.equal(module.body.weight, nn.Linear(4, 4).weight)  # the body's own stream, nothing else's


def test_another_seed_gives_other_values():
    a, b = Tied(), Tied()
    seeded_init(a, seed=1)
    seeded_init(b, seed=2)
    assert not torch.equal(a.body.weight, b.body.weight)


def test_a_module_without_an_initialiser_is_refused_before_anything_is_allocated():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        module = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\) owns \['gain'\] but defines no reset_parameters\(\)"):
        plan_initialisation(module, seed=0)


def test_tensors_with_storage_beside_meta_ones_are_refused():
    module = nn.Sequential(nn.Linear(4, 4))
    with torch.device("meta"):
        module.append(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="holds tensors with storage .*0.weight.* beside tensors on the meta"):
        plan_initialisation(module, seed=0)


def test_parallelize_refuses_a_meta_model_without_a_materialization(world_of_one):
    layout, mesh = world_of_one
    with torch.device("meta"):
        module = Tied()
    with pytest.raises(ValueError, match="is on the meta device: pass materialization="):
        parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1), adapter=adapt(module))
    with torch.device("meta"):
        module = Tied()
    parallelize(module, meshes=mesh, options=ParallelOptions(data_parallel_size=1), adapter=adapt(module),
                build=BuildSettings(materialization=Materialization(torch.device("cpu"), 3)))
    assert not any(p.is_meta for p in module.parameters()) and module.head.weight is module.embed.weight
