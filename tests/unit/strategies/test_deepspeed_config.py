"""DeepSpeed config building, conflict checks, registry names, timeouts and bad input; no processes."""

from __future__ import annotations

import inspect
import json
from datetime import timedelta

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_parallel.parallel.options import DEFAULT_TIMEOUT
from lightning_parallel.strategies.deepspeed.strategy import REGISTERED, DeepSpeedDataParallelStrategy
from lightning_parallel.strategies.deepspeed.config import apply_precision, apply_trainer_settings, build_zero_config


def test_timeout_defaults_to_the_suite_default_and_takes_seconds():
    assert DeepSpeedDataParallelStrategy().timeout == DEFAULT_TIMEOUT
    assert DeepSpeedDataParallelStrategy(timeout=None).timeout == DEFAULT_TIMEOUT  # conf/strategy: timeout: null
    assert DeepSpeedDataParallelStrategy(timeout=90).timeout == timedelta(seconds=90)
    with pytest.raises(ValueError, match="positive"):
        DeepSpeedDataParallelStrategy(timeout=0)


def test_lightning_ddp_timeout_equals_the_suite_default():
    # conf/strategy/ddp.yaml leaves the timeout to Lightning's DDPStrategy on that ground.
    assert inspect.signature(DDPStrategy.__init__).parameters["timeout"].default == DEFAULT_TIMEOUT


def test_explicit_arguments_build_the_zero_section():
    config = build_zero_config(3, offload_optimizer=True, offload_parameters=True)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_force_ds_cpu_optimizer"] is False  # torch optimizers are allowed with offload


def test_raw_config_is_merged_under_the_arguments_and_left_untouched():
    raw = {
        "zero_optimization": {"reduce_bucket_size": 1000, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 7,
    }
    snapshot = json.dumps(raw, sort_keys=True)
    config = build_zero_config(2, offload_optimizer=True, config=raw)
    assert config["zero_optimization"] == {
        "reduce_bucket_size": 1000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},  # the raw block's details are kept
        "stage": 2,
    }
    assert config["steps_per_print"] == 7
    assert json.dumps(raw, sort_keys=True) == snapshot


def test_raw_config_may_repeat_an_argument(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": False}))
    config = build_zero_config(3, config=path)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_allow_untested_optimizer"] is False  # not an argument: the raw value stays


def test_raw_config_from_hydra_is_accepted():
    from omegaconf import OmegaConf

    raw = OmegaConf.create({"zero_optimization": {"reduce_bucket_size": 10}, "optimizer_betas_example": [0.9, 0.95]})
    config = build_zero_config(1, config=raw)
    assert config["optimizer_betas_example"] == [0.9, 0.95] and type(config["zero_optimization"]) is dict


def test_raw_stage_that_contradicts_the_argument_is_refused():
    with pytest.raises(
        ValueError, match=r"zero_optimization.stage=3 but the strategy has zero_stage=2.*pass zero_stage=3"
    ):
        build_zero_config(2, config={"zero_optimization": {"stage": 3}})


def test_offload_asked_but_switched_off_in_raw_config_is_refused():
    with pytest.raises(ValueError, match="offload_optimizer=True.*does not offload"):
        build_zero_config(
            2, offload_optimizer=True, config={"zero_optimization": {"offload_optimizer": {"device": "none"}}}
        )


@pytest.mark.parametrize("stage", [-1, 4, "2", True, 2.5])
def test_unknown_stage_is_refused(stage):
    with pytest.raises(ValueError, match="is not a ZeRO stage: use 0, 1, 2 or 3"):
        DeepSpeedDataParallelStrategy(zero_stage=stage)


@pytest.mark.parametrize(
    ("stage", "kwargs", "match"),
    [
        (2, {"offload_parameters": True}, "stage 2 cannot offload parameters.*stage>=3"),
        (1, {"offload_parameters": True, "offload_optimizer": True}, "cannot offload parameters"),
        (0, {"offload_optimizer": True}, "stage 0 cannot offload optimizer state.*stage>=1"),
        (
            2,
            {"config": {"zero_optimization": {"offload_param": {"device": "cpu"}}}},
            "stage 2 cannot offload parameters",
        ),
    ],
)
def test_offload_the_stage_cannot_do_is_refused(stage, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedDataParallelStrategy(zero_stage=stage, **kwargs)


def test_supported_offloads_are_accepted():
    assert DeepSpeedDataParallelStrategy(zero_stage=1, offload_optimizer=True).config["zero_optimization"][
        "offload_optimizer"
    ]
    strategy = DeepSpeedDataParallelStrategy(zero_stage=3, offload_optimizer=True, offload_parameters=True)
    assert strategy.zero_stage_3


def test_bad_config_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_zero_config(2, config=tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_zero_config(2, config=broken)
    with pytest.raises(ValueError, match="must be a JSON object"):
        build_zero_config(2, config=[1, 2])


def test_trainer_settings_fill_batch_accumulation_and_clipping():
    config = apply_trainer_settings(
        {}, micro_batch_size=8, accumulate_grad_batches=2, gradient_clip_val=None, data_parallel_size=2
    )
    assert config == {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,  # never DeepSpeed's default 1.0 when the Trainer does not clip
        "train_batch_size": 32,
    }
    assert apply_trainer_settings({}, 4, 1, 0.5, 1)["gradient_clipping"] == 0.5


def test_raw_config_may_repeat_trainer_settings():
    raw = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "train_batch_size": 32,
    }
    assert apply_trainer_settings(dict(raw), 8, 2, 1.0, 2) == raw


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"train_micro_batch_size_per_gpu": 4},
            r"train_micro_batch_size_per_gpu=4 but the train dataloader's batch_size gives 8",
        ),
        ({"gradient_accumulation_steps": 4}, r"accumulate_grad_batches"),
        ({"gradient_clipping": 1.0}, r"gradient_clipping=1.0 but Trainer\(gradient_clip_val=...\) gives 0.0"),
        ({"train_batch_size": 64}, r"train_batch_size=64 but batch_size x accumulate_grad_batches x ranks gives 16"),
    ],
)
def test_raw_config_contradicting_the_trainer_is_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        apply_trainer_settings(
            raw, micro_batch_size=8, accumulate_grad_batches=1, gradient_clip_val=None, data_parallel_size=2
        )


def test_precision_on_cpu_is_fp32_or_bf16():
    assert apply_precision({}, "32-true", "cpu") == {}
    for precision in ("16-mixed", "16-true"):
        with pytest.raises(ValueError, match="not supported by DeepSpeed on CPU.*run on CUDA"):
            apply_precision({}, precision, "cpu")
    # bf16: tests/unit/parallel/test_precision.py


def test_precision_on_cuda_uses_deepspeed_blocks():
    assert apply_precision({}, "bf16-true", "cuda")["bf16"] == {"enabled": True}
    assert apply_precision({}, "16-mixed", "cuda") == {"fp16": {"enabled": True}}
    # Loss-scale options in a raw fp16 block stay; the Trainer decides only whether it is on.
    raw = {"fp16": {"enabled": True, "initial_scale_power": 12}}
    assert apply_precision(raw, "16-mixed", "cuda")["fp16"]["initial_scale_power"] == 12


@pytest.mark.parametrize(
    ("raw", "precision"),
    [
        ({"bf16": {"enabled": True}}, "32-true"),
        ({"fp16": {"enabled": True}}, "bf16-mixed"),
        ({"bf16": {"enabled": False}}, "bf16-true"),
    ],
)
def test_raw_precision_contradicting_the_trainer_is_refused(raw, precision):
    with pytest.raises(ValueError, match=r"Trainer\(precision="):
        apply_precision(raw, precision, "cuda")


def test_registered_names_and_their_arguments():
    DeepSpeedDataParallelStrategy.register_strategies(StrategyRegistry)
    DeepSpeedDataParallelStrategy.register_strategies(StrategyRegistry)  # idempotent
    expected = {
        "deepspeed_zero1": {"zero_stage": 1},
        "deepspeed_zero2": {"zero_stage": 2},
        "deepspeed_zero3": {"zero_stage": 3},
        "deepspeed_zero3_offload": {"zero_stage": 3, "offload_optimizer": True, "offload_parameters": True},
    }
    assert set(REGISTERED) == set(expected)
    for name, init_params in expected.items():
        assert StrategyRegistry[name]["strategy"] is DeepSpeedDataParallelStrategy
        assert StrategyRegistry[name]["init_params"] == init_params
        strategy = StrategyRegistry.get(name)
        assert strategy.config["zero_optimization"]["stage"] == init_params["zero_stage"] == strategy.zero_stage


def test_registered_name_builds_a_cpu_trainer():
    import lightning.pytorch as pl

    DeepSpeedDataParallelStrategy.register_strategies(StrategyRegistry)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="deepspeed_zero2", logger=False, enable_checkpointing=False
    )
    assert isinstance(trainer.strategy, DeepSpeedDataParallelStrategy)
    assert trainer.strategy.config["zero_optimization"]["stage"] == 2


def _composed_strategy(*overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from lightning_parallel.runtime.config_dir import CONFIG_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, "paths.output_dir=/tmp/lp-compose-test"])
    finally:
        GlobalHydra.instance().clear()
    return instantiate(cfg.strategy)


def test_hydra_configs_instantiate_the_registered_settings():
    # deepspeed_zero<N>.yaml are aliases of deepspeed.yaml (a defaults entry plus the lines that differ).
    for name, (_, init_params) in REGISTERED.items():
        strategy = _composed_strategy(f"strategy={name}")
        assert isinstance(strategy, DeepSpeedDataParallelStrategy), name
        for key, value in init_params.items():
            assert getattr(strategy, key) == value, (name, key)
        assert strategy.timeout == DEFAULT_TIMEOUT, name  # `timeout: null` in the file


def test_one_deepspeed_config_takes_the_stage_by_the_hybrid_strategys_name():
    assert _composed_strategy("strategy=deepspeed").zero_stage == 2
    strategy = _composed_strategy("strategy=deepspeed", "strategy.zero_stage=3")
    assert strategy.zero_stage == 3 and strategy.zero_stage_3


def test_stage_is_the_deprecated_name_of_zero_stage():
    with pytest.warns(FutureWarning, match=r"stage=3\) is deprecated: use zero_stage=3"):
        strategy = DeepSpeedDataParallelStrategy(stage=3)
    assert strategy.zero_stage == strategy.stage == 3 and strategy.config["zero_optimization"]["stage"] == 3
    with pytest.warns(FutureWarning):
        assert DeepSpeedDataParallelStrategy(zero_stage=1, stage=1).zero_stage == 1
    with pytest.raises(ValueError, match="zero_stage=1 and its deprecated name stage=3: pass zero_stage only"), \
            pytest.warns(FutureWarning):
        DeepSpeedDataParallelStrategy(zero_stage=1, stage=3)
    assert DeepSpeedDataParallelStrategy().zero_stage == 2
