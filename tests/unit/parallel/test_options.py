"""ParallelOptions: validated once, frozen, one default timeout."""

from datetime import timedelta

import pytest
from omegaconf import OmegaConf

from lightning_parallel.parallel.options import DEFAULT_TIMEOUT, ParallelOptions


def test_defaults_and_the_single_default_timeout():
    options = ParallelOptions()
    assert options.timeout == DEFAULT_TIMEOUT == timedelta(minutes=30)
    assert ParallelOptions(timeout=90).timeout == timedelta(seconds=90)


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        ParallelOptions().zero_stage = 2


def test_hydra_containers_become_plain_values():
    options = ParallelOptions(partition=OmegaConf.create([2, 4]), plan=OmegaConf.create({"blocks.*.up": "colwise"}),
                              pipeline_parallel_size=3, stages_per_rank=1)
    assert options.partition == (2, 4) and options.plan == {"blocks.*.up": "colwise"} and type(options.plan) is dict


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"timeout": -1}, "positive"), ({"partition": [1.5]}, "cut points"), ({"zero_stage": True}, "zero_stage"),
     ({"data_parallel_size": 0}, ">= 1"), ({"microbatches": 0}, "positive integer")],
)
def test_bad_options_raise_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelOptions(**kwargs)
