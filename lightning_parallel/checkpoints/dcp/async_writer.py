"""Write DCP checkpoint folders in the background: the step waits only while the state is copied to CPU memory.

A save copies this rank's shards to CPU memory (pinned on CUDA) and returns; a background thread writes them into
the hidden ``.<name>.partial`` folder with DCP's ``async_save`` (its collectives on a gloo group of their own, so
they never interleave with the training's), and once every rank's shards and DCP's metadata are written, the
coordinator's thread adds Lightning's metadata and renames the folder into place (:func:`~.writer.commit`), exactly
as a synchronous save does. At most one save is in flight: the next save, the run's end and a stop wait for it.
A process killed mid-write leaves only the hidden partial folder, so the resume logic still takes the previous
complete checkpoint.

Note:
    Staging is synchronous on purpose. DCP's default stager can also copy in the background, which on CUDA
    overlaps the copy on a side stream; on the CPU the optimizer would then update the parameters while they are
    being copied, and the checkpoint would mix two steps. Lightning's own ``AsyncCheckpointIO`` hands the whole
    write, staging included, to a thread (its issue tracker calls it unsafe for that reason), and cannot write the
    suite's sharded folder.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_parallel.checkpoints.dcp.writer import commit, drop_stale_partial, partial_path

__all__ = ["AsyncCheckpointWriter", "cpu_group_for_async_save"]


class AsyncCheckpointWriter:
    """Sharded checkpoints written in the background, one in flight, committed atomically by the coordinator.

    Args:
        group: a process group over every rank with a CPU backend (gloo), used only by the background writes.
        pinned: stage into pinned CPU memory (CUDA runs: the copy from the device is faster).
    """

    def __init__(self, group: Any, pinned: bool = False) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.group = group
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        self._in_flight: Optional[Future] = None
        self._committed = threading.Event()
        self._commit_error: Optional[BaseException] = None
        self.saves = 0  # started (for the tests and the benchmark)

    def save(self, path: Path, state: dict[str, Any], metadata: dict[str, Any], is_coordinator: bool,
             barrier: Callable[[], None]) -> None:
        """Stage ``state`` and write it to ``path`` in the background (every rank calls this).

        Args:
            path: the final folder name (e.g. ``.../last.ckpt``); it appears only once complete.
            state: ``{"state_dict": ..., "optimizer_0": ...}`` of this rank (DCP-sharded).
            metadata: Lightning's remaining checkpoint dict (copied now: training goes on changing its sources).
            is_coordinator: True on exactly one rank (global rank 0).
            barrier: a barrier over all ranks.
        """
        from torch.distributed.checkpoint import async_save

        self.wait()  # the previous save is complete on every rank before this one starts
        if is_coordinator:
            drop_stale_partial(path)
        barrier()
        metadata = copy.deepcopy(metadata)
        self._committed.clear()
        self._commit_error = None
        future = async_save(state, checkpoint_id=partial_path(path), process_group=self.group,
                            async_stager=self._stager)
        self.saves += 1
        future.add_done_callback(lambda done: self._finish(done, path, metadata, is_coordinator))
        self._in_flight = future

    def _finish(self, done: Future, path: Path, metadata: dict[str, Any], is_coordinator: bool) -> None:
        try:
            if is_coordinator and done.exception() is None:
                commit(path, metadata)  # every rank's shards and DCP's .metadata are written: make it visible
        except BaseException as error:  # re-raised by wait(), on the training thread
            self._commit_error = error
        finally:
            self._committed.set()

    @property
    def in_flight(self) -> bool:
        """Whether a save has started and not yet been waited for."""
        return self._in_flight is not None

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and committed; re-raise its error."""
        future, self._in_flight = self._in_flight, None
        if future is None:
            return
        future.result()  # the write's own error, on the training thread
        self._committed.wait()
        if self._commit_error is not None:
            raise self._commit_error

    def close(self) -> None:
        """Wait for the save in flight and free the staging buffers."""
        try:
            self.wait()
        finally:
            self._stager.close()


def cpu_group_for_async_save(timeout: Any = None) -> Any:
    """A new process group over every rank on which the background writes run (a collective: every rank calls it).

    Gloo: the staged shards are in CPU memory, and a group of their own keeps DCP's planning collectives from
    interleaving with the training's on the default group.

    Args:
        timeout: the run's collective timeout (``timedelta``; None: torch's default).
    """
    return torch.distributed.new_group(backend="gloo", timeout=timeout)
