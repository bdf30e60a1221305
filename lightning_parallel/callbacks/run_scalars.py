"""What TensorBoard shows beside the losses: the gradient norm and memory per step, every rank's peak, and the
run's final figures, all in the run's one event file.

Note:
    Nothing here adds a collective to a training step. The gradient norm is the one the suite's clipping already
    computed (:class:`~lightning_parallel.strategies.hybrid.clipping.GlobalNormClipping` keeps it), and only rank 0
    writes, so per step it logs its own memory; every rank's peak travels to rank 0 once, in one all-gather after
    the last step. The final figures are written in ``on_fit_end``, before Lightning closes the logger: written
    after ``fit``, they reopened the writer, which starts a second event file.
"""

from __future__ import annotations

import resource
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

GRAD_NORM = "grad_norm"


def peak_memory(device: torch.device) -> tuple[str, float]:
    """This process's peak memory in MiB and its TensorBoard tag: CUDA's max allocated on a CUDA device, else the
    peak resident set (``ru_maxrss``, KiB on Linux).

    Args:
        device: the rank's root device.
    """
    if device.type == "cuda":
        return "memory/max_allocated_mib", torch.cuda.max_memory_allocated(device) / 2**20
    return "memory/max_rss_mib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


class RunScalars(pl.Callback):
    """Logs ``grad_norm`` and rank 0's peak memory every optimizer step, every rank's peak at the end of training
    (``memory/rank<r>/max_rss_mib`` or ``.../max_allocated_mib``), then calls ``at_fit_end``.

    ``grad_norm`` is the global norm (every pipeline stage and tensor shard) that gradient clipping by norm
    computed; a run that does not clip by norm on the suite's strategies has no ``grad_norm`` scalar.

    Args:
        at_fit_end: called with the Trainer in ``on_fit_end``, while the logger is still open (``lp-train`` logs
            its hyperparameters with the final metrics there).
    """

    def __init__(self, at_fit_end: Optional[Callable[[pl.Trainer], None]] = None) -> None:
        self.at_fit_end = at_fit_end
        self.peaks: dict[int, float] = {}
        self._logged_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._logged_step = trainer.global_step  # after a resume's restore

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._logged_step:
            return  # an accumulation micro-batch: no optimizer step yet
        self._logged_step = trainer.global_step
        plugin = trainer.strategy.precision_plugin
        norm = getattr(plugin, "last_norm", None)  # None where nothing clipped by the global norm
        if norm is not None:
            plugin.last_norm = None
        if trainer.global_rank != 0:
            return
        tag, peak = peak_memory(trainer.strategy.root_device)
        scalars = {tag: peak} if norm is None else {tag: peak, GRAD_NORM: float(norm)}
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = trainer.strategy.root_device
        tag, peak = peak_memory(device)
        mine = torch.tensor([peak], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
        else:
            every = [mine]
        self.peaks = {rank: float(value) for rank, value in enumerate(every)}
        if trainer.global_rank != 0:
            return
        name = tag.split("/", 1)[1]
        scalars = {f"memory/rank{rank}/{name}": value for rank, value in self.peaks.items()}
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_fit_end is not None:
            self.at_fit_end(trainer)
