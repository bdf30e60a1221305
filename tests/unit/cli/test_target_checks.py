"""Every _target_ of the config against the signature it is called with (lightning_parallel.cli.target_checks)."""

import pytest

from lightning_parallel.cli.overrides_check import config_repository
from lightning_parallel.cli.plan import compose
from lightning_parallel.cli.target_checks import check_targets
from lightning_parallel.runtime.config_dir import CONFIG_DIR


@pytest.mark.parametrize(("override", "message"), [
    ("+model.dropuot=0.1", r"^model\.dropuot is not an argument of lightning_parallel\.examples\.nlp\.model\.GPT: "
                           r"did you mean model\.dropout\? It takes vocab_size, "),
    ("+data.bach_size=3", r"^data\.bach_size is not an argument of .*TextDataModule: did you mean data\.batch_size\?"),
    ("+model.optimizer.lrr=1", r"^model\.optimizer\.lrr is not an argument of torch\.optim\.AdamW: did you mean "
                               r"model\.optimizer\.lr\?"),
    ("model.optimizer._target_=torch.optim.Adamw", r"^model\.optimizer\._target_=torch\.optim\.Adamw cannot be "
                                                   r"imported: check the name \(module torch\.optim\)"),
])
def test_a_key_the_target_does_not_take_is_named_with_the_closest(override, message):
    with pytest.raises(ValueError, match=message):
        check_targets(compose([override]))


def test_a_target_taking_any_keyword_accepts_any_key():
    check_targets(compose(["strategy=hybrid", "+strategy.anything=1"]))  # the strategy's own check names it


def test_every_option_of_every_group_passes():
    with config_repository(str(CONFIG_DIR)) as loader:
        choices = [(group, option) for group in ("model", "data", "strategy", "experiment", "callbacks", "logger")
                   for option in loader.get_group_options(group)]
    for group, option in choices:
        check_targets(compose([f"{group}={option}"]))


def test_settings_added_to_a_strategy_given_by_name_are_refused():
    with pytest.raises(ValueError, match=r"^strategy has settings \(microbatches\) but no _target_ .* choose a "
                                         r"strategy that has them\.$"):
        check_targets(compose(["strategy=single", "+strategy.microbatches=2"]))
