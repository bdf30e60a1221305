"""One fault at one moment of a run, on one rank: what the fault matrix (``python -m benchmarks.fault_matrix``)
injects, usable in your own tests too::

    trainer = Trainer(..., callbacks=[InjectFault(FaultPoint("hang", "backward", rank=1, step=5)), ...])

Moments are places in the program, not only in the step count: ``forward`` and ``backward`` fire inside the
autograd graph (a forward hook on the first module with parameters that this rank holds, and a gradient hook on its
output), so they land inside a pipeline schedule, an FSDP2 unit or a DDP bucket exactly where a real fault would;
``optimizer_step`` before the update; ``save`` as a checkpoint is being written; ``start-up`` and ``resume`` in the
``setup`` hook (before the checkpoint is read: ``resume`` damages it there, as a disk or a clean-up job would while
the other ranks read it). Each fires once, at its step, and writes ``time.time()`` to ``stamp`` when it does, so the
time from the fault to its detection can be measured.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

FAULTS = ("kill", "hang", "slow", "nan", "sigterm", "sigint", "disk_full", "truncate", "delete")
MOMENTS = ("start-up", "forward", "backward", "optimizer_step", "save", "resume")
KILLED_EXIT_CODE = 17
_ONLY_AT = {"truncate": ("resume",), "delete": ("resume",), "disk_full": ("save",), "nan": ("forward", "backward")}


@dataclass(frozen=True)
class FaultPoint:
    """Where and what.

    Args:
        fault: one of :data:`FAULTS`. ``kill``: exit at once (no clean-up, code 17); ``hang``: sleep for good;
            ``slow``: sleep ``slow_s`` once (a straggler); ``nan``: NaN in the activations (forward) or their
            gradients (backward); ``sigterm``/``sigint``: the signal to this process; ``disk_full``: this process
            may write no more than 512 bytes per file from the save on (``RLIMIT_FSIZE``: writes fail with
            ``EFBIG``, as on a full disk they fail with ``ENOSPC``); ``truncate``/``delete``: the largest file of the
            checkpoint being resumed is cut to half its size / removed.
        moment: one of :data:`MOMENTS`.
        rank: the global rank it fires on.
        step: the optimizer step (``trainer.global_step``) it fires at; ignored at start-up and resume.
        slow_s: the straggler's pause.
        stamp: a file that gets the wall-clock time of the fault.
        checkpoint: the checkpoint a ``truncate``/``delete`` fault damages (the run's ``ckpt_path``).
    """

    fault: str
    moment: str
    rank: int
    step: int = 0
    slow_s: float = 3.0
    stamp: Optional[str] = None
    checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS or self.moment not in MOMENTS:
            raise ValueError(f"FaultPoint({self.fault!r}, {self.moment!r}): fault is one of {FAULTS}, moment one of "
                             f"{MOMENTS}.")
        if self.moment not in _ONLY_AT.get(self.fault, MOMENTS):
            raise ValueError(f"A {self.fault!r} fault fires only at {_ONLY_AT[self.fault]}, not at {self.moment!r}.")


def damage_checkpoint(path: Path, how: str) -> Path:
    """Cut the largest file of a checkpoint (a file, or a folder's largest file) to half, or delete it.

    Args:
        path: a checkpoint file or folder.
        how: ``"truncate"`` or ``"delete"``.

    Returns:
        The file damaged.
    """
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    if not files:
        raise ValueError(f"{path} holds no file to damage.")
    target = max(files, key=lambda p: p.stat().st_size)
    if how == "delete":
        target.unlink()
    else:
        os.truncate(target, target.stat().st_size // 2)
    return target


class InjectFault(pl.Callback):
    """Fires one :class:`FaultPoint` in this process when its rank, step and moment come (once).

    Args:
        point: the fault.
    """

    def __init__(self, point: FaultPoint) -> None:
        self.point = point
        self.fired = False
        self._hooks: list[Any] = []

    def _fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self.point.stamp:
            Path(self.point.stamp).write_text(repr(time.time()))
        fault = self.point.fault
        if fault == "kill":
            os._exit(KILLED_EXIT_CODE)
        elif fault == "hang":
            time.sleep(10**6)
        elif fault == "slow":
            time.sleep(self.point.slow_s)
        elif fault in ("sigterm", "sigint"):
            os.kill(os.getpid(), signal.SIGTERM if fault == "sigterm" else signal.SIGINT)
        elif fault == "disk_full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def _mine(self, trainer: pl.Trainer, moment: str) -> bool:
        return (not self.fired and self.point.moment == moment and trainer.global_rank == self.point.rank
                and (moment in ("start-up", "resume") or trainer.global_step == self.point.step))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning sets trainer.ckpt_path only after this hook: the point says whether this run resumes.
        if not self._mine(trainer, self.point.moment) or self.point.moment not in ("start-up", "resume"):
            return
        if self.point.fault in ("truncate", "delete"):
            self.fired = True
            if not self.point.checkpoint:
                raise ValueError(f"A {self.point.fault!r} fault needs FaultPoint(checkpoint=...): the one resumed.")
            target = damage_checkpoint(Path(self.point.checkpoint), self.point.fault)
            if self.point.stamp:
                Path(self.point.stamp).write_text(repr(time.time()))
            print(f"fault: {self.point.fault} {target}", flush=True)
            return
        self._fire()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._mine(trainer, "forward") or self._mine(trainer, "backward"):
            self._arm(pl_module)

    def _arm(self, pl_module: pl.LightningModule) -> None:
        """Forward hooks on every module with parameters of its own; the first to return a tensor (an embedding
        collection returns keyed tensors or awaitables) is where the fault fires, or whose output's gradient it
        fires in."""
        nan = self.point.fault == "nan"
        hooked: list[bool] = []

        def on_forward(mod: Any, args: Any, output: Any) -> Any:
            if self.fired or hooked or not isinstance(output, torch.Tensor):
                return None
            hooked.append(True)
            if self.point.moment == "forward":
                self._fire()
                return output * math.nan if nan else None
            if output.requires_grad:
                output.register_hook(lambda grad: self._on_gradient(grad, nan))
            return None

        for module in pl_module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._hooks.append(module.register_forward_hook(on_forward))

    def _on_gradient(self, grad: Any, nan: bool) -> Any:
        if self.fired:
            return None
        self._fire()
        return grad * math.nan if nan else None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._mine(trainer, "optimizer_step"):
            self._fire()

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self._mine(trainer, "save"):
            self._fire()
