"""Real 4-rank DeepSpeed ZeRO 0-3 runs of the tiny GPT measuring what each rank stores, and the same stages simulated
by DeepSpeed's partition arithmetic (``tests/distributed/planner/test_simulation_deepspeed.py``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from tests.distributed.planner.simulation_runs import WORLD, gpt, stored_bytes

STAGES = (0, 1, 2, 3)


class HeldInFirstStep(pl.Callback):
    """DeepSpeed's storages in the first step: gradients after backward (before the engine's step: the parameters'
    own under ZeRO 0; this rank's partition of the reduced gradients under ZeRO 1 and 2, counted in elements -- they
    are views into DeepSpeed's reduction buffers --; ZeRO 3's flat gradient partitions), and after the step the
    parameters (the flat buffers, ZeRO 3's partitions and its gathered persistent parameters) and the optimizer's
    fp32 master partitions and state."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.gradients = -1

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        if self.gradients >= 0:
            return
        zero = trainer.strategy.model.optimizer
        averaged = [t for ts in (getattr(zero, "averaged_gradients", None) or {}).values() if ts for t in ts]
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO 3: views of its flat gradient partitions
            self.gradients = stored_bytes(averaged)
        elif hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO 1, 2
            self.gradients = sum(t.numel() * t.element_size() for t in averaged)
        else:
            self.gradients = stored_bytes([p.grad for p in module.parameters() if p.grad is not None])

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if self.held:
            return
        zero = trainer.strategy.model.optimizer
        inner = getattr(zero, "optimizer", zero)
        params = list(module.parameters())
        parameters = stored_bytes([p.data for p in params if p.data.numel()]
                                  + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None])
        master = list(getattr(zero, "single_partition_of_fp32_groups", None)
                      or getattr(zero, "fp32_partitioned_groups_flat", None) or [])
        state = [v for s in inner.state.values() for v in s.values() if hasattr(v, "shape")]
        self.held = {"parameter_bytes": parameters, "gradient_bytes": self.gradients,
                     "optimizer_bytes": stored_bytes(master + state) if master else stored_bytes(state)}


def measure_deepspeed(rank: int, world_size: int, stages: list[int]) -> dict[int, dict[str, int]]:
    """Fit one step of the tiny GPT under each ZeRO stage; this rank's bytes per stage."""
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData
    from tests.distributed.parity_runs import text_dataset

    out = {}
    for stage in stages:
        pl.seed_everything(0)
        recorder = HeldInFirstStep()
        trainer = quiet_trainer(world_size, DeepSpeedDataParallelStrategy(zero_stage=stage), 1, [recorder],
                                limit_val_batches=0)
        trainer.fit(gpt(), datamodule=FixedOrderData(text_dataset(32, 16), batch_size=2))
        out[stage] = recorder.held
    return out


def simulated_deepspeed(stage: int) -> Any:
    """ZeRO ``stage`` on :data:`WORLD` ranks by DeepSpeed's partition arithmetic (its default config otherwise)."""
    from lightning_parallel.cli.simulate_strategies import simulate_deepspeed
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    return simulate_deepspeed(gpt, DeepSpeedDataParallelStrategy(zero_stage=stage), WORLD, "32-true")
