"""Wall time of each training step, the one timer the benchmarks share."""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepTimes(Callback):
    """Seconds of each training step on this rank, ``on_train_batch_start`` to ``on_train_batch_end`` (the loader's
    wait for the batch is not inside it)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
