"""Leaving the process groups at the end of a run: together after a success, at once after a failure."""

from __future__ import annotations

import logging


def leave_process_group(together: bool) -> None:
    """Destroy this process's process groups, if any (a multirun runs its next job in this process: a clean slate).

    Args:
        together: first wait at a barrier until every rank has finished its end of the run (after a success). Rank 0
            writes the results after the last step while the other ranks have nothing left to do; a rank that tore
            its groups down and exited meanwhile was seen aborting in its exit ("terminate called without an active
            exception", a torchrun restart on the loaded 2-core machine), which torchrun reports as a failed run.
            False after a failure: its peers may never arrive at a barrier.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if together:
        try:
            dist.barrier()  # bounded by the group's timeout, as every collective of a run
        except Exception as error:  # noqa: BLE001 - a peer already gone: nothing to wait for, leave anyway
            logging.getLogger("lightning_parallel").debug("no barrier before leaving the process group: %s", error)
    dist.destroy_process_group()
