"""Single values refused before any process starts, naming the user's key (lightning_parallel.cli.value_checks)."""

import pytest

from lightning_parallel.cli import value_checks as values
from lightning_parallel.cli.plan import compose
from lightning_parallel.layout import ParallelLayout

BASE = ["model=gpt_tiny", "trainer=cpu_test", "logger=none", "callbacks=none"]


def _layout(dp=1, pp=1):
    return ParallelLayout(world_size=dp * pp, data_parallel=dp, pipeline_parallel=pp, tensor_parallel=1)


def _cfg(*overrides):
    return compose([*BASE, *overrides])


def test_a_negative_learning_rate_names_model_optimizer_lr():
    with pytest.raises(ValueError, match=r"model\.optimizer\.lr=-0\.001 is not a positive learning rate.*lr=3e-4"):
        values.check_scaling(_cfg("model.optimizer.lr=-0.001"), _layout())


def test_a_zero_batch_names_data_batch_size_not_the_scaling_argument():
    with pytest.raises(ValueError, match=r"^data\.batch_size=0 must be a positive integer: give 1 or more\.$"):
        values.check_scaling(_cfg("data.batch_size=0"), _layout())


def test_scaling_is_checked_on_a_copy_and_returns_the_effective_values():
    cfg = _cfg("scaling=linear", "scaling.reference.global_batch_size=8", "scaling.reference.lr=0.001")
    effective = values.check_scaling(cfg, _layout(dp=2))
    assert effective.global_batch_size == 32 and effective.lr == pytest.approx(0.004)
    assert cfg.model.optimizer.lr == 3e-3  # the config itself is rescaled later, once, by the run


def test_microbatches_that_do_not_divide_the_batch_name_both_keys_and_the_choices():
    cfg = _cfg("strategy=pipeline", "strategy.microbatches=3")
    with pytest.raises(ValueError, match=r"data\.batch_size=16 .* strategy\.microbatches=3 .*\[1, 2, 4, 8, 16\].*"
                                         r"data\.batch_size=18"):
        values.check_microbatches(cfg, _layout(pp=2), 16)
    values.check_microbatches(cfg, _layout(dp=2), 16)  # no pipeline: microbatches unused


@pytest.mark.parametrize(("key", "typed", "meant"), [
    ("schedule", "1f1f", "1f1b"), ("partition", "paramters", "parameters"), ("context_parallel_method", "ulyses",
                                                                              "ulysses"),
    ("activation_checkpointing", "ful", "full"),
])
def test_a_mistyped_strategy_choice_suggests_the_closest(key, typed, meant):
    with pytest.raises(ValueError, match=rf"strategy\.{key}='{typed}' is not a choice: did you mean "
                                         rf"strategy\.{key}={meant}\?"):
        values.check_strategy_choices(_cfg("strategy=hybrid", f"strategy.{key}={typed}"))


def test_a_mistyped_compile_backend_suggests_inductor_and_never_lists_testing_backends():
    with pytest.raises(ValueError, match="did you mean strategy.compile=inductor") as caught:
        values.check_strategy_choices(_cfg("strategy=hybrid", "strategy.compile=inductr"))
    assert "TESTING_ONLY" not in str(caught.value)
    assert all(not b.endswith("_TESTING_ONLY") for b in values.compile_backends())
    values.check_strategy_choices(_cfg("strategy=hybrid", "strategy.compile=aot_eager"))  # a real backend passes


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.max_steps=0", r"trainer\.max_steps=0 trains nothing"),
    ("trainer.val_check_interval=0", r"trainer\.val_check_interval=0: give a number of batches"),
    ("trainer.val_check_interval=1.5", r"trainer\.val_check_interval=1\.5: give"),
    ("trainer.gradient_clip_val=-1", r"trainer\.gradient_clip_val=-1 is negative"),
    ("trainer.precision=bf16mixed", r"did you mean trainer\.precision=bf16-mixed\?"),
])
def test_trainer_values_name_their_key(override, message):
    with pytest.raises(ValueError, match=message):
        values.check_trainer_values(_cfg(override))


@pytest.mark.parametrize(("override", "message"), [
    ("data.seq_len=0", r"data\.seq_len=0 must be 1 or more"),
    ("data.num_workers=-1", r"data\.num_workers=-1 is negative"),
])
def test_data_values_name_their_key(override, message):
    with pytest.raises(ValueError, match=message):
        values.check_data_values(_cfg(override))


@pytest.mark.parametrize(("override", "message"), [
    ("model.optimizer.betas=[0.9,1.5]", r"model\.optimizer\.betas=\[0\.9, 1\.5\]: each must be in \[0, 1\)"),
    ("model.weight_decay=-0.1", r"model\.weight_decay=-0\.1 is negative"),
    ("+model.optimizer.eps=-1e-8", r"model\.optimizer\.eps=-1e-08 is negative"),
])
def test_optimizer_values_name_their_key(override, message):
    with pytest.raises(ValueError, match=message):
        values.check_optimizer(_cfg(override))


def test_the_recipes_defaults_pass_every_value_check():
    for strategy in ("ddp", "pipeline", "hybrid", "tensor"):
        cfg = _cfg(f"strategy={strategy}")
        values.check_trainer_values(cfg)
        values.check_data_values(cfg)
        values.check_strategy_choices(cfg)
        values.check_optimizer(cfg)


def test_a_choice_with_no_close_match_is_left_to_the_strategys_own_message():
    values.check_strategy_choices(_cfg("strategy=context", "strategy.context_parallel_method=flash"))
    values.check_strategy_choices(_cfg("strategy=hybrid", "strategy.compile=xyzzy"))
