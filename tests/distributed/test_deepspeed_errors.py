"""Bad DeepSpeed settings that only the Trainer reveals fail with a ValueError before the first step."""

from __future__ import annotations

import re

import pytest

from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import LossHistory, run_processes
from lightning_parallel.testing.fit import quiet_trainer
from lightning_parallel.testing.models import FixedOrderData, ResidualMLP, regression_dataset

pytestmark = pytest.mark.slow

# name -> (strategy config, Trainer arguments)
CASES = {
    "clipping": ({"gradient_clipping": 1.0}, {}),
    "micro_batch": ({"train_micro_batch_size_per_gpu": 3}, {}),
    "accumulation": ({"gradient_accumulation_steps": 4}, {"accumulate_grad_batches": 2}),
    "clip_by_value": (None, {"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}),
    "fp16_on_cpu": (None, {"precision": "16-true"}),
}


def _fit_expecting_errors(rank: int, world_size: int) -> dict[str, tuple[str, str, int]]:
    """Try each bad case in one process; record the exception and how many batches ran."""
    out = {}
    for name, (config, trainer_kwargs) in CASES.items():
        history = LossHistory()
        strategy = DeepSpeedDataParallelStrategy(zero_stage=2, config=config)
        trainer = quiet_trainer(world_size, strategy, 2, [history], **trainer_kwargs)
        try:
            trainer.fit(ResidualMLP(), datamodule=FixedOrderData(regression_dataset(64, 32), batch_size=16))
            out[name] = ("no error", "", len(history.losses))
        except Exception as err:  # noqa: BLE001 - the test inspects what was raised
            out[name] = (type(err).__name__, str(err), len(history.losses))
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[str, str, int]]:
    return run_processes(_fit_expecting_errors, 1)[0]


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("clipping", r"gradient_clipping=1.0 but Trainer\(gradient_clip_val=...\) gives 0.0"),
        ("micro_batch", r"train_micro_batch_size_per_gpu=3 but the train dataloader's batch_size gives 16"),
        ("accumulation", r"gradient_accumulation_steps=4 but Trainer\(accumulate_grad_batches=...\) gives 2"),
        ("clip_by_value", r"clips gradients by norm only"),
        ("fp16_on_cpu", r"precision='16-true' is not supported by DeepSpeed on CPU"),
    ],
)
def test_contradiction_fails_before_training(outcomes, name, match):
    kind, message, batches = outcomes[name]
    assert kind == "ValueError", (name, kind, message)
    assert re.search(match, message), message
    assert batches == 0
