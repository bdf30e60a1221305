"""``compile``: the option names a backend or is refused, and ``parallelize`` compiles exactly this rank's layers."""

import pytest
import torch

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.compile import compile_backend
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.testing.models import ResidualMLP


def _compiled(module: torch.nn.Module) -> bool:
    """Whether the module's forward is a compiled one (an instance attribute ``torch.compile`` made)."""
    return hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")  # what torch.compile's wrapper has


def test_true_is_inductor_and_a_backend_name_is_kept():
    assert compile_backend(True) == "inductor"
    assert compile_backend("aot_eager") == "aot_eager"
    assert ParallelOptions(compile="aot_eager").compile == "aot_eager"


@pytest.mark.parametrize("value", ["inductr", 1, "none"])
def test_a_value_naming_no_backend_is_refused_with_the_backends(value):
    with pytest.raises(ValueError, match="compile=.*use True \\(inductor\\), False, or a torch.compile backend.*"
                                         "aot_eager"):
        ParallelOptions(compile=value)


def test_the_option_is_part_of_the_settings_a_parallelised_module_keeps():
    assert ParallelOptions(compile=True).settings != ParallelOptions().settings


def test_parallelize_compiles_every_layer_and_nothing_else(world_of_one):
    module = ResidualMLP(width=8, depth=3)
    layout = ParallelLayout(1, 1, 1, 1)
    parallelize(module, meshes=world_of_one[1], options=ParallelOptions(compile="eager"), adapter=adapt(module))
    assert [_compiled(layer) for layer in module.pipeline_layers()] == [True] * len(module.pipeline_layers())
    assert not _compiled(module)
    x = torch.randn(4, 8)
    module(x).sum().backward()  # runs through the compiled layers
    assert all(p.grad is not None for p in module.parameters())


def test_without_the_option_nothing_is_compiled(world_of_one):
    module = ResidualMLP(width=8, depth=2)
    layout = ParallelLayout(1, 1, 1, 1)
    parallelize(module, meshes=world_of_one[1], options=ParallelOptions(), adapter=adapt(module))
    assert not any(_compiled(m) for m in module.modules())


def test_compile_beside_checkpointing_under_tensor_parallelism_is_refused_naming_the_ways_out():
    with pytest.raises(ValueError, match="drop activation_checkpointing .*or compile=false"):
        ParallelOptions(compile=True, activation_checkpointing="full", tensor_parallel_size=2)
    ParallelOptions(compile=True, activation_checkpointing="full")  # without tensor parallelism: compiled
    ParallelOptions(compile=True, tensor_parallel_size=2)  # without checkpointing: compiled


def test_a_typo_suggests_the_backend_and_torchs_testing_backends_are_never_offered():
    with pytest.raises(ValueError, match="did you mean compile='inductor'\\?") as caught:
        compile_backend("inductr")
    assert "TESTING_ONLY" not in str(caught.value)
