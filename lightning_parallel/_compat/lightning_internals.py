"""Lightning's private hooks and undocumented layouts the suite relies on (the door: :mod:`lightning_parallel._compat`).

Each touch point says why it is private; ``tests/unit/test_compat.py`` has a canary for each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's own helper, used by every built-in strategy's ``setup``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_module_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` return ``mesh`` (read in ``configure_model``).

    Why private: ``LightningModule.device_mesh`` has no setter; Lightning's
    ModelParallelStrategy assigns ``_device_mesh`` the same way.
    """
    module._device_mesh = mesh


def init_model_parallel_process_group(strategy: Any, default_backend: Optional[str] = None) -> None:
    """Join the default process group as ModelParallelStrategy does (cluster env, ranks, backend, timeout).

    Why private: ``ModelParallelStrategy._setup_distributed`` is the only Lightning entry that
    does all of it; re-implementing it would copy ``_init_dist_connection`` (private as well).
    ``default_backend`` replaces Lightning's default by device when the user chose no backend
    (Lightning keeps the choice in ``_process_group_backend``).
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if default_backend is not None and strategy._process_group_backend is None:
        strategy._process_group_backend = default_backend
    ModelParallelStrategy._setup_distributed(strategy)


# Why private: Lightning's step redirection through a wrapped module (DeepSpeed's engine)
# has no public base class; the ZeRO-3 strategy refines it (see strategies/deepspeed/steps.py).
DDPForwardRedirection = _DDPForwardRedirection


def set_forward_redirection(strategy: Any, redirection: Any) -> None:
    """Replace a DeepSpeed strategy's step redirection (no public setter; read by ``training_step`` & co)."""
    strategy._forward_redirection = redirection


# Private hooks of Lightning's DeepSpeedStrategy that DeepSpeedDataParallelStrategy overrides,
# with why. A rename upstream would silently bypass the override, so the compat test checks
# each still exists with these parameters.
DEEPSPEED_STRATEGY_OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "_setup_model_and_optimizer": (
        ("self", "model", "optimizer", "lr_scheduler"),
        "deepspeed.initialize with a device rank that exists on CPU",
    ),
    "_initialize_deepspeed_inference": (("self", "model"), "the same CPU-safe device rank for evaluation engines"),
    "_format_config": (("self",), "Trainer settings win over a raw config instead of being refused or ignored"),
}


def auto_select_batch_size(strategy: Any) -> int:
    """The train loader's batch size, as Lightning's DeepSpeedStrategy infers it for
    ``train_micro_batch_size_per_gpu``."""
    return strategy._auto_select_batch_size()


def init_deepspeed_distributed(strategy: Any) -> None:
    """Join the process group through DeepSpeed (Lightning's own step, minus its CUDA device-index check)."""
    strategy._init_deepspeed_distributed()


def remove_module_hooks(model: nn.Module) -> None:
    """Drop a training engine's hooks before an inference engine wraps the model (undocumented Lightning helper)."""
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks as remove

    remove(model)


def fit_loop_train_dataloader(trainer: pl.Trainer) -> Any:
    """The training loader of a fit, however it was given (``fit(train_dataloaders=...)`` included).

    Why private: the public routes (``datamodule.train_dataloader()``,
    ``module.train_dataloader()``) miss loaders passed straight to ``fit``; the fit loop's
    data source is the one place that knows all three.
    """
    return trainer.fit_loop._data_source.dataloader()


# Lightning's fit-loop checkpoint layout (undocumented, 2.5-2.6): checkpoint key -> the
# progress object under ``trainer.fit_loop.epoch_loop`` that Lightning saves there.
_EPOCH_LOOP_PROGRESS = {
    "epoch_loop.batch_progress": ("batch_progress",),
    "epoch_loop.scheduler_progress": ("scheduler_progress",),
    "epoch_loop.automatic_optimization.optim_progress": ("automatic_optimization", "optim_progress"),
}


def drop_per_step_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning's training loop broadcasting rank 0's SIGTERM flag before every step (``_TrainingEpochLoop.
    _broadcast_sigterm_tensor``): a collective per step that a raw loop does not have. Only for a trainer whose
    SIGTERM the suite's handlers took (:class:`~lightning_parallel.callbacks.GracefulStop`): Lightning's flag is
    then never set, and the suite's own agreement carries the stop, every ``agree_every_s`` seconds.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def fit_loop_state(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The fit loop's entry of a Lightning checkpoint dict (``checkpoint["loops"]["fit_loop"]``), or None."""
    return checkpoint.get("loops", {}).get("fit_loop")


def epoch_end_loop_progress(trainer: pl.Trainer) -> dict[str, Any]:
    """``{checkpoint key: live progress object}`` of the epoch loop's per-epoch counters."""
    out = {}
    for key, path in _EPOCH_LOOP_PROGRESS.items():
        value: Any = trainer.fit_loop.epoch_loop
        for attribute in path:
            value = getattr(value, attribute)
        out[key] = value
    return out


def drop_loader_position(fit_state: dict[str, Any]) -> None:
    """Remove the saved data-loader position from a fit-loop checkpoint entry.

    Lightning stores it as ``combined_loader``.
    """
    fit_state.get("state_dict", {}).pop("combined_loader", None)
