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


def test_units_of_layers_under_zero_2_and_what_is_refused():
    """ZeRO 2 groups layers into FSDP2 units of ``bucket_size_mb`` (parameters stay gathered from forward to backward
    there anyway); ZeRO 3, which gathers each unit again in backward, keeps one unit per layer; prefetch counts
    layers, so it cannot meet units of several."""
    assert ParallelOptions(zero_stage=2).bucket_bytes == 0  # default: one unit per layer
    assert ParallelOptions(zero_stage=2, bucket_size_mb=25).bucket_bytes == 25 * 2**20
    assert ParallelOptions(zero_stage=0).bucket_bytes == 25 * 2**20  # DDP's default bucket
    with pytest.raises(ValueError, match="zero_stage=3 gathers each unit again in backward.*zero_stage=2"):
        ParallelOptions(zero_stage=3, bucket_size_mb=25)
    with pytest.raises(ValueError, match="fsdp_prefetch counts layers.*drop one"):
        ParallelOptions(zero_stage=2, bucket_size_mb=25, fsdp_prefetch=2)
    assert ParallelOptions(zero_stage=2, bucket_size_mb=0, fsdp_prefetch=2).bucket_bytes == 0
