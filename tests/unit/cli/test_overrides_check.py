"""Did-you-mean for group options and keys, from Hydra's config repository (lightning_parallel.cli.overrides_check)."""

import pytest

from lightning_parallel.cli.overrides_check import check_overrides
from lightning_parallel.runtime.config_dir import CONFIG_DIR


def _check(*overrides):
    check_overrides(list(overrides), str(CONFIG_DIR))


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy=hybird"], r"^strategy=hybird is not in conf/strategy/: did you mean strategy=hybrid\? Choose one of "
                          r"context, ddp, "),
    (["experiment=nlp_gtp"], r"^experiment=nlp_gtp is not in conf/experiment/: did you mean experiment=nlp_gpt\?"),
    (["model=gpt_tny"], r"did you mean model=gpt_tiny\?"),
    (["strategy=HYBRID"], r"did you mean strategy=hybrid\?"),
    (["-m", "strategy=ddp,hybird"], r"^strategy=hybird is not in conf/strategy/"),  # each option of a sweep
])
def test_an_unknown_group_option_is_one_line_with_the_closest(overrides, message):
    with pytest.raises(ValueError, match=message) as caught:
        _check(*[o for o in overrides if "=" in o])
    assert "\n" not in str(caught.value) and "search path" not in str(caught.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy=hybrid", "strategy.tensor_paralel_size=2"],
     r"^strategy\.tensor_paralel_size is not a setting of strategy=hybrid: did you mean "
     r"strategy\.tensor_parallel_size=2\?$"),
    (["model.optimzer.lr=0.1"], r"did you mean model\.optimizer\.lr=0\.1\?$"),
    (["data.batchsize=4"], r"^data\.batchsize is not a setting of data=text: did you mean data\.batch_size=4\?$"),
])
def test_a_mistyped_key_suggests_the_closest_key_with_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        _check(*overrides)


def test_a_key_of_another_option_names_the_options_that_have_it_instead_of_hydras_plus():
    with pytest.raises(ValueError) as caught:
        _check("strategy=ddp", "strategy.tensor_parallel_size=2")
    message = str(caught.value)
    assert message.startswith("strategy.tensor_parallel_size is not a setting of strategy=ddp; strategy=")
    assert "add strategy=tensor (a '+' would pass it to ddp, which does not take it)" in message
    with pytest.raises(ValueError, match=r"strategy=single; .*pipeline.* have it: add strategy=hybrid"):
        _check("strategy=single", "strategy.microbatches=2")  # single's strategy is Lightning's name: no settings


def test_an_unknown_key_without_a_close_one_lists_what_is_there():
    with pytest.raises(ValueError, match=r"strategy\.foo is not a setting of strategy=hybrid: strategy has _target_"):
        _check("strategy=hybrid", "strategy.foo=1")


@pytest.mark.parametrize("overrides", [
    ["strategy=hybrid", "strategy.tensor_parallel_size=1", "trainer.devices=2"],
    ["experiment=nlp_gpt", "data.batch_size=8"],
    ["+strategy.new_key=1"],  # a new key on purpose: Hydra's business
    ["-m", "strategy=ddp,pipeline", "strategy.microbatches=2"],  # a sweep: each job composes its own
    ["hydra.run.dir=outputs/x", "logger=none", "callbacks=none", "experiment=null"],
    ["model.optimizer.betas=[0.9,0.99]"],
])
def test_valid_command_lines_pass(overrides):
    _check(*[o for o in overrides if "=" in o])


def test_a_key_another_override_adds_is_a_key():
    _check("+model.moe={num_experts:2}", "model.moe.num_experts=4")
    _check("~callbacks.evaluation", "trainer.max_steps=3")


def test_a_key_under_a_null_setting_says_to_give_the_setting_whole():
    with pytest.raises(ValueError, match=r"strategy\.plan is null; give it whole, e\.g\. strategy\.plan=\{foo:1\}"):
        _check("strategy=hybrid", "strategy.plan.foo=1")


def test_a_short_unknown_key_gets_no_far_fetched_suggestion_but_the_option_that_has_it():
    with pytest.raises(ValueError) as caught:
        _check("model.moe.num_experts=4")  # gpt has no moe setting; d_model is no typo of it
    assert "did you mean" not in str(caught.value) and "model=gpt_moe has it: add model=gpt_moe" in str(caught.value)
