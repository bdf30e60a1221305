"""One signature for options: ``options=`` or keywords (never positional), unknown names and conflicts refused."""

from dataclasses import fields, replace

import pytest

from lightning_parallel.parallel.options import ParallelOptions, option_names, options_from
from lightning_parallel.strategies import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy


def test_options_are_keywords_only():
    with pytest.raises(ValueError, match="options is a ParallelOptions"):
        HybridParallelStrategy(2)
    with pytest.raises(TypeError):
        HybridParallelStrategy(None, "gloo")  # process_group_backend is a keyword too


def test_an_options_object_and_keywords_build_the_same_strategy():
    options = ParallelOptions(pipeline_parallel_size=2, zero_stage=2, microbatches=8, timeout=60)
    by_object = HybridParallelStrategy(options=options)
    by_keywords = HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=2, microbatches=8, timeout=60)
    assert by_object.options == by_keywords.options and by_object.options is options
    assert by_object.resolve_layout(4).shape == (2, 2, 1)


def test_keywords_that_agree_with_options_are_accepted_and_conflicts_name_the_fix():
    options = ParallelOptions(pipeline_parallel_size=2, partition=[2], timeout=60)
    assert HybridParallelStrategy(options, pipeline_parallel_size=2, partition=(2,), timeout=60).options is options
    with pytest.raises(ValueError, match=r"zero_stage=3 \(options has 0\).*dataclasses.replace"):
        HybridParallelStrategy(options, zero_stage=3)
    assert HybridParallelStrategy(replace(options, zero_stage=3)).options.zero_stage == 3


def test_unknown_names_list_the_valid_ones_with_the_closest():
    with pytest.raises(
        ValueError, match=r"'zero_stag' \(did you mean 'zero_stage'\?\).*microbatches.*load_optimizer_state"
    ):
        HybridParallelStrategy(zero_stag=2)
    with pytest.raises(
        ValueError, match=r"PipelineParallelStrategy got unknown option\(s\) 'micro_batches' \(did you mean"
    ):
        PipelineParallelStrategy(micro_batches=2)
    with pytest.raises(ValueError, match=r"'stage' \(did you mean 'zero_stage'\?\)"):
        HybridParallelStrategy(stage=2)


def test_a_mapping_of_options_is_taken_as_hydra_gives_it():
    from omegaconf import OmegaConf

    built = options_from(OmegaConf.create({"pipeline_parallel_size": 2, "partition": [1]}), {})
    assert built.pipeline_parallel_size == 2 and built.partition == (1,)


def test_presets_keep_their_defaults_for_keywords_and_take_options_as_they_are():
    assert PipelineParallelStrategy().resolve_layout(4).shape == (1, 4, 1)
    assert TensorParallelStrategy(tensor_parallel_size=2).resolve_layout(4).shape == (2, 1, 2)
    options = ParallelOptions(pipeline_parallel_size=2)
    assert PipelineParallelStrategy(options=options).resolve_layout(4).shape == (2, 2, 1)
    assert PipelineParallelStrategy(options=options, process_group_backend="gloo").options is options


def test_strategy_only_arguments_stay_outside_the_options():
    strategy = HybridParallelStrategy(process_group_backend="gloo", load_optimizer_state=False, zero_stage=2)
    assert strategy.load_optimizer_state is False and strategy.options.zero_stage == 2
    assert "process_group_backend" not in option_names() and "load_optimizer_state" not in option_names()


def test_every_option_is_documented_once_on_parallel_options():
    doc = ParallelOptions.__doc__
    for field in fields(ParallelOptions):
        assert doc.count(f"\n        {field.name}: ") == 1, field.name
    assert "see :class:`~lightning_parallel.parallel.options.ParallelOptions`" in HybridParallelStrategy.__doc__
    for name in ("microbatches:", "sequence_parallel:", "param_dtype"):
        assert name not in HybridParallelStrategy.__doc__
