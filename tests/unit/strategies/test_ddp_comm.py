"""``ddp_strategy``: DDP communication hooks chosen by name, validated before any process starts."""

from pathlib import Path

import pytest
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import OmegaConf
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_parallel.cli.train import CONFIG_DIR
from lightning_parallel.strategies.ddp_comm import CommHookDDPStrategy, ddp_strategy


def test_no_hook_is_lightnings_ddp_strategy_unchanged():
    assert type(ddp_strategy(bucket_cap_mb=5)) is DDPStrategy


@pytest.mark.parametrize(("name", "hook"), [("fp16", default_hooks.fp16_compress_hook),
                                             ("bf16", default_hooks.bf16_compress_hook)])
def test_compression_hooks_are_torchs_own(name, hook):
    strategy = ddp_strategy(comm_hook=name)
    assert isinstance(strategy, CommHookDDPStrategy) and isinstance(strategy, DDPStrategy)
    assert strategy.comm_hook is hook and strategy.comm_state is None


def test_powersgd_gets_its_state_with_rank_and_warm_up():
    strategy = ddp_strategy(comm_hook="powersgd", powersgd_rank=4, powersgd_start_iter=50, timeout=60)
    assert strategy.comm_hook is powerSGD_hook
    state = strategy.comm_state
    assert isinstance(state, PowerSGDState) and state.process_group is None
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (4, 50)
    assert (state.use_error_feedback, state.warm_start) == (True, True)
    defaults = ddp_strategy(comm_hook="powersgd").comm_state
    assert (defaults.matrix_approximation_rank, defaults.start_powerSGD_iter) == (1, 10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"comm_hook": "int8"}, r"Unknown comm_hook='int8': use one of \('none', 'fp16', 'bf16', 'powersgd'\)"),
        ({"comm_hook": "powersgd", "powersgd_rank": 0}, r"powersgd_rank=0 must be an integer >= 1"),
        ({"comm_hook": "powersgd", "powersgd_rank": 1.5}, r"powersgd_rank=1.5 must be an integer"),
        (
            {"comm_hook": "powersgd", "powersgd_start_iter": 1},
            r"powersgd_start_iter=1 must be an integer >= 2.*rebuilt",
        ),
        ({"comm_hook": "fp16", "powersgd_rank": 4}, r"powersgd_rank=4 configures PowerSGD.*set comm_hook=powersgd"),
        ({"powersgd_start_iter": 5}, r"comm_hook='none': set comm_hook=powersgd, or drop it"),
        ({"comm_hook": "bf16", "ddp_comm_hook": print}, r"\['ddp_comm_hook'\] would register a second hook"),
    ],
)
def test_bad_settings_fail_early_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ddp_strategy(**kwargs)


def test_the_ddp_config_keeps_lightnings_strategy_by_default_and_takes_a_hook():
    cfg = OmegaConf.load(Path(CONFIG_DIR) / "strategy" / "ddp.yaml")
    assert type(instantiate(cfg.strategy)) is DDPStrategy
    cfg.strategy.comm_hook, cfg.strategy.powersgd_rank = "powersgd", 4
    assert instantiate(cfg.strategy).comm_state.matrix_approximation_rank == 4


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_the_hybrid_strategy_refuses_ddp_only_hooks_naming_this_strategy(hook):
    from lightning_parallel.parallel.options import ParallelOptions

    with pytest.raises(ValueError, match=rf"data-parallel-only layout strategy=ddp strategy.comm_hook={hook}"):
        ParallelOptions(comm_hook=hook)
