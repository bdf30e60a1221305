"""The suite's own Python logger, ``lightning_parallel``, with Lightning's conventions: rank-zero and levels.

A user filters or silences the suite's messages as any library's, apart from Lightning's::

    logging.getLogger("lightning_parallel").setLevel(logging.WARNING)   # the suite's notes off, its warnings on

:func:`rank_zero_info`, :func:`rank_zero_warn` and :func:`rank_zero_debug` log on global rank 0 only (the rank
Lightning's strategies set, else ``RANK`` of the environment), as Lightning's own functions of those names do for
its logger. Messages of every rank go through :data:`logger` itself.

Note:
    As Lightning does for ``lightning.pytorch``, the logger gets a console handler of its own (level INFO) when
    the application configured no logging before it was imported, and then does not propagate, so each line is
    printed once. :func:`lightning_parallel.cli.run_start.route_logs_to_file` copies it into the run's log file.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("lightning_parallel")

if not logging.getLogger().handlers and not logger.handlers:
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler())
    logger.propagate = False


def global_rank() -> int:
    """This process's global rank: the one Lightning's strategies set (``rank_zero_only.rank``), else ``RANK``."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    return int(rank)


def rank_zero_info(message: str, *args: Any) -> None:
    """Log ``message`` at INFO on global rank 0 only.

    Args:
        message: the message (``%`` arguments as in :mod:`logging`).
        args: its arguments.
    """
    if global_rank() == 0:
        logger.info(message, *args, stacklevel=2)


def rank_zero_warn(message: str, *args: Any) -> None:
    """Log ``message`` at WARNING on global rank 0 only.

    Args:
        message: the message (``%`` arguments as in :mod:`logging`).
        args: its arguments.
    """
    if global_rank() == 0:
        logger.warning(message, *args, stacklevel=2)


def rank_zero_debug(message: str, *args: Any) -> None:
    """Log ``message`` at DEBUG on global rank 0 only.

    Args:
        message: the message (``%`` arguments as in :mod:`logging`).
        args: its arguments.
    """
    if global_rank() == 0:
        logger.debug(message, *args, stacklevel=2)
