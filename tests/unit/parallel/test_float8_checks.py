"""``float8`` options refused before any process starts, each naming the fix; the device check at set-up."""

import pytest
import torch

from lightning_parallel.parallel.float8 import checks
from lightning_parallel.parallel.options import ParallelOptions


@pytest.fixture
def torchao_installed(monkeypatch):
    monkeypatch.setattr(checks, "torchao_version", lambda: "0.18.0")


def test_unknown_recipe_names_the_two(torchao_installed):
    with pytest.raises(ValueError, match=r"Unknown float8='tensorwize': use 'tensorwise' .* or 'rowwise'"):
        ParallelOptions(float8="tensorwize")


def test_missing_torchao_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(checks, "torchao_version", lambda: None)
    with pytest.raises(ValueError, match=r"torchao is not installed: pip install 'lightning-parallel\[float8\]'"):
        ParallelOptions(float8="tensorwise")


def test_torchao_older_than_checked_is_refused(monkeypatch):
    monkeypatch.setattr(checks, "torchao_version", lambda: "0.12.0")
    with pytest.raises(ValueError, match="needs torchao 0.18 or newer"):
        ParallelOptions(float8="rowwise")


def test_fp8_all_gather_with_rowwise_scales_is_refused_as_torchao_refuses_it(torchao_installed):
    with pytest.raises(ValueError, match="one scale per tensor only.*Use float8='tensorwise'"):
        ParallelOptions(float8="rowwise", zero_stage=3, float8_all_gather=True)


def test_fp8_all_gather_needs_something_sharded(torchao_installed):
    with pytest.raises(ValueError, match="zero_stage=0 shards nothing: set zero_stage=3"):
        ParallelOptions(float8="tensorwise", float8_all_gather=True)


def test_fp8_all_gather_without_float8_is_refused():
    with pytest.raises(ValueError, match="float8 is off"):
        ParallelOptions(float8_all_gather=False)


def test_accepted_options_say_how_the_data_axis_gathers(torchao_installed):
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.parallel.float8.convert import uses_float8_all_gather

    data2 = ParallelLayout(2, 2, 1, 1)
    assert uses_float8_all_gather(ParallelOptions(float8="tensorwise", zero_stage=3), data2)
    assert uses_float8_all_gather(ParallelOptions(float8="tensorwise", zero_stage=2), data2)
    assert not uses_float8_all_gather(ParallelOptions(float8="rowwise", zero_stage=3), data2)
    assert not uses_float8_all_gather(ParallelOptions(float8="tensorwise"), data2)  # ZeRO 0 gathers nothing
    assert not uses_float8_all_gather(ParallelOptions(float8="tensorwise", zero_stage=3, float8_all_gather=False),
                                      data2)
    assert not uses_float8_all_gather(ParallelOptions(float8="tensorwise", zero_stage=3), ParallelLayout(1, 1, 1, 1))


def test_a_gpu_without_fp8_tensor_cores_is_refused_and_other_devices_emulate(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"A100-SXM4-80GB is sm_80: drop strategy.float8"):
        checks.check_float8_device("tensorwise", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    checks.check_float8_device("tensorwise", torch.device("cuda", 0))
    checks.check_float8_device("rowwise", torch.device("cpu"))
    checks.check_float8_device(None, torch.device("cuda", 0))


@pytest.mark.parametrize("target", ["lightning_parallel.strategies.deepspeed.DeepSpeedDataParallelStrategy",
                                    "lightning_parallel.strategies.torchrec.TorchRecStrategy",
                                    "lightning_parallel.strategies.ddp_comm.ddp_strategy"])
def test_strategies_without_an_fp8_path_are_refused_in_preflight(target):
    from omegaconf import OmegaConf

    from lightning_parallel.cli.value_checks import check_float8_strategy

    cfg = OmegaConf.create({"strategy": {"_target_": target, "float8": "tensorwise"}})
    with pytest.raises(ValueError, match="has no FP8 path.*Use strategy=hybrid strategy.zero_stage=3"):
        check_float8_strategy(cfg)
    check_float8_strategy(OmegaConf.create({"strategy": {"_target_": target, "float8": None}}))
    hybrid = OmegaConf.create({"strategy": {"_target_": "lightning_parallel.strategies.TensorParallelStrategy",
                                            "float8": "rowwise"}})
    check_float8_strategy(hybrid)
