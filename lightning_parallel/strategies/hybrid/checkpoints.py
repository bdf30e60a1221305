"""The hybrid strategy's checkpoint writing and reading: a sharded DCP folder out, any writer the suite reads in.

Kept beside :mod:`lightning_parallel.strategies.hybrid.strategy` so that module stays Lightning's lifecycle; the work
itself is :mod:`lightning_parallel.checkpoints`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.checkpoints import optimizer_state_dict, resolve_checkpoint, save_sharded_checkpoint
from lightning_parallel.checkpoints.lightning.writer import parameter_order_entry
from lightning_parallel.checkpoints.resume import resume_from


def save_strategy_checkpoint(strategy: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any],
                             optimizers: list[Optimizer]) -> None:
    """Write ``checkpoint`` as the strategy's sharded folder (every rank calls this).

    Args:
        strategy: the ``HybridParallelStrategy``.
        checkpoint: Lightning's checkpoint dict (``state_dict`` and ``optimizer_states`` are taken out of it).
        filepath: the folder to write.
        storage_options: must be ``None`` (DCP writes the folder).
        optimizers: the torch optimizers, in ``configure_optimizers`` order.
    """
    if storage_options is not None:
        raise TypeError(
            f"{type(strategy).__name__}.save_checkpoint does not take storage_options (it writes with DCP)."
        )
    path = Path(strategy.broadcast(str(filepath)))
    checkpoint["lightning_parallel"] = {
        "layout": strategy.layout.shape, "zero_stage": strategy.options.zero_stage,
        "schedule": strategy.options.schedule,
    }
    # The configure_optimizers order of parameters (a collective: every rank saves), so
    # `lp-convert --to lightning` can key optimizer state by index as Lightning does.
    checkpoint["lightning_parallel"].update(parameter_order_entry(strategy.lightning_module, optimizers))
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    writer = getattr(strategy, "async_writer", None)
    if writer is not None:  # async_save: the step waits only for the copy to CPU memory
        writer.save(path, state, checkpoint, strategy.global_rank == 0, strategy.barrier)
    else:
        save_sharded_checkpoint(path, state, checkpoint, strategy.global_rank == 0, strategy.barrier)


def load_strategy_checkpoint(strategy: Any, checkpoint_path: Any, weights_only: Optional[bool],
                             optimizers: list[Optimizer]) -> dict[str, Any]:
    """Load ``checkpoint_path`` (the suite's folder, Lightning's files or folders, DeepSpeed's) onto the layout.

    Args:
        strategy: the ``HybridParallelStrategy``.
        checkpoint_path: what the user gave as ``ckpt_path``.
        weights_only: passed to ``torch.load`` for single files.
        optimizers: the torch optimizers to restore.
    """
    path = resolve_checkpoint(Path(strategy.broadcast(str(checkpoint_path))))
    if not path.exists():
        raise FileNotFoundError(
            f"Checkpoint {str(path)!r} does not exist: "
            "check ckpt_path (ModelCheckpoint names files by its filename=)."
        )
    return resume_from(
        path, strategy.lightning_module, optimizers, strict=strategy.lightning_module.strict_loading,
        load_optimizer_state=strategy.load_optimizer_state, weights_only=weights_only,
        local_coordinator=strategy.local_rank == 0, reader=f"{type(strategy).__name__} ({strategy.strategy_name})",
    )


def checked_load_optimizer_state(value: Any) -> bool:
    """``load_optimizer_state`` if it is a bool; else a ``ValueError`` saying what each value does."""
    if not isinstance(value, bool):
        raise ValueError(
            f"load_optimizer_state must be True (restore ckpt_path's optimizer state or refuse) or False (start the "
            f"optimizer afresh), not {value!r}."
        )
    return value


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class HybridCheckpointIO:
    """The hybrid strategy's checkpoint hooks (mixed in before Lightning's ``ModelParallelStrategy``): optimizer state
    under unsharded names, a sharded DCP folder out, any writer the suite reads in, resharded onto this layout.

    ``ckpt_path`` may name the suite's folder, a Lightning single-file checkpoint (single device, DDP, FSDP full
    state), a Lightning DCP folder (``ModelParallelStrategy``, ``FSDPStrategy`` sharded) or a DeepSpeed ZeRO 0-3
    folder; see :mod:`lightning_parallel.checkpoints.resume`.
    """

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self.options.save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        return optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a sharded DCP folder that appears under ``filepath`` only when every rank has finished."""
        checkpoint.update(self.adapter.checkpoint_metadata())
        if not self.options.save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        save_strategy_checkpoint(self, checkpoint, filepath, storage_options, [unwrap_optimizer(o) for o in self.optimizers])

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load ``checkpoint_path`` from any writer the suite reads, resharded onto this layout
        (see the class docstring)."""
        return load_strategy_checkpoint(self, checkpoint_path, weights_only, [unwrap_optimizer(o) for o in self.optimizers])
