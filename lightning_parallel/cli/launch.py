"""Start the other ranks of a single-node run from the entry point.

Note:
    Lightning's own subprocess launcher re-runs ``sys.argv`` for ranks 1..N-1. Under a
    Hydra multirun (``-m strategy=ddp trainer.devices=1,2``) that would make every child
    run the whole sweep again (hydra#2070, lightning-hydra-template#393). Here each job of
    a sweep starts its own children for that one job: on CPU by forking after the imports and
    checks (:mod:`.forked_rank`: the child runs the job the launcher composed), on CUDA from
    that job's *resolved* config, written to ``.lp/<run id>/config.yaml`` in the job's folder;
    each such child checks that file's run id and SHA-256 (from its environment) before using
    it, so it runs exactly that one job, never a file another run wrote. Rank 0 is the current
    process; it gets the same environment ``torchrun`` would give, so Lightning sees the
    processes as externally launched and does not launch again. Children run in their own
    session (a terminal's Ctrl-C reaches the launcher, which forwards it once to each:
    :mod:`lightning_parallel.runtime.signals`) and die with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.errors import earlier_rank_error, read_rank_error
from lightning_parallel.cli.forked_rank import fork_rank, start_method
from lightning_parallel.cli.run_folder import ENV_CONFIG_SHA, ENV_RUN_ID, verify_rank_config, write_rank_config
from lightning_parallel.runtime import signals
from lightning_parallel.runtime.ports import free_port

_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK", "LOCAL_WORLD_SIZE")



def launched_externally() -> bool:
    """True when torchrun, SLURM or a parent launcher already started every rank."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return "LOCAL_RANK" in os.environ or TorchElasticEnvironment.detect() or SLURMEnvironment.detect()


def processes_to_launch(devices: Any, num_nodes: int) -> int:
    """How many local processes this entry point must start itself (0: none, leave it to Lightning).

    Args:
        devices: ``trainer.devices`` from the config.
        num_nodes: ``trainer.num_nodes``.

    Raises:
        ValueError: several nodes requested without a launcher that starts processes on them.
    """
    if launched_externally():
        return 0
    if num_nodes > 1:
        raise ValueError(
            f"trainer.num_nodes={num_nodes} needs a launcher on every node: run under torchrun "
            "(--nnodes, --node-rank, --rdzv-endpoint) or SLURM (srun, or hydra/launcher=slurm); see docs/cluster.md."
        )
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 1:
        return devices
    return 0


class _ChildWatcher(threading.Thread):
    """Kills the whole run if a child rank dies: the others would wait for it forever.

    A child that exits during a stop (SIGINT/SIGTERM, :mod:`lightning_parallel.runtime.signals`) is expected.
    """

    def __init__(self, children: list[subprocess.Popen], run_dir: Path) -> None:
        super().__init__(daemon=True, name="lp-child-watcher")
        self.children = children
        self.run_dir = run_dir
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            failed = [(i + 1, c.returncode) for i, c in enumerate(self.children) if c.poll() not in (None, 0)]
            if failed and not signals.stop_requested():
                rank, code = failed[0]
                # The rank left its error line instead of printing it (cli/train.py): shown here once.
                line = read_rank_error(self.run_dir, rank)
                print(f"lp-train: error (rank {rank}): {line}" if line else
                      f"lp-train: rank {rank} exited with code {code}; stopping all ranks (see rank{rank}.log).",
                      file=sys.stderr, flush=True)
                for child in self.children:
                    if child.poll() is None:
                        child.kill()
                os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def restored_rank_environment() -> Iterator[None]:
    """Undo the rank variables a job leaves in ``os.environ``.

    Lightning's own launcher writes ``LOCAL_RANK``/``WORLD_SIZE`` into the parent's
    environment even for one device; the next job of a multirun would then believe it was
    launched externally with the old world size.
    """
    saved = {key: os.environ.get(key) for key in (*_RANK_ENV, "OMP_NUM_THREADS")}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_child(rank: int, config_dir: Path, run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start local rank ``rank`` on the per-run configuration in ``config_dir``."""
    command = [
        sys.executable, "-m", "lightning_parallel.cli.train",
        f"--config-path={config_dir}", "--config-name=config",
        # Quoted: sweep folders carry '=' and ',' from the overrides, which Hydra's grammar would parse.
        f"hydra.run.dir='{run_dir}'", "hydra.output_subdir=null", f"hydra.job.name=rank{rank}",
    ]  # fmt: skip
    # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once to every rank.
    return subprocess.Popen(command, env=env, start_new_session=True)


def _stop_children(children: list[subprocess.Popen], timeout: float) -> None:
    """Wait for the children up to ``timeout`` seconds in all, then kill those still running."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _after_rank_zero_failed(error: BaseException, watcher: _ChildWatcher, children: list[subprocess.Popen],
                            run_dir: Path) -> None:
    """Stop the children after rank 0 failed; raise the error of a child that failed first, when there is one."""
    failed_at = time.time()
    watcher.stopped.set()
    # Rank 0 failed: the others wait in a collective for it; a short grace, then kill.
    _stop_children(children, timeout=3.0)
    cause = earlier_rank_error(run_dir, range(1, len(children) + 1), failed_at, error)
    if cause is not None:  # rank 0 only saw a peer leave: the peer's error is the one to show
        raise cause from error


def _start_ranks(cfg: DictConfig, run_dir: Path, nprocs: int, run_id: str,
                 rank_body: Optional[Callable[[], int]], rank_env: dict[str, str]) -> list[Any]:
    """Start ranks 1..nprocs-1, forked (``rank_body``) or as new interpreters; see :func:`local_ranks`."""
    method = start_method(cfg.trainer.get("accelerator", "auto")) if rank_body is not None else "spawn"
    # Written for forked ranks too: the record of the exact configuration every rank of this run trains on.
    resolved = OmegaConf.to_yaml(OmegaConf.to_container(cfg, resolve=True))
    config_dir, sha256 = write_rank_config(run_dir, run_id, resolved)
    identity = {ENV_RUN_ID: run_id, ENV_CONFIG_SHA: sha256, "LP_PARENT_PID": str(os.getpid())}
    children: list[Any] = []
    for rank in range(1, nprocs):
        env = {**os.environ, **rank_env, **identity, "LOCAL_RANK": str(rank), "RANK": str(rank)}
        children.append(fork_rank(rank, env, run_dir, rank_body) if method == "fork"
                        else _start_child(rank, config_dir, run_dir, env))
    return children


@contextmanager
def local_ranks(cfg: DictConfig, run_dir: Path, nprocs: int, run_id: str,
                rank_body: Optional[Callable[[], int]] = None) -> Iterator[None]:
    """Start ranks 1..nprocs-1 as children and make this process rank 0 for the duration.

    Children are forked from this process where that is safe (CPU runs on Linux: :mod:`.forked_rank`), so they
    start with the imports and checks done; otherwise each is a new interpreter on the resolved config.

    Args:
        cfg: the job's composed config (resolved and written to ``run_dir/.lp/<run_id>/config.yaml``).
        run_dir: the job's output folder, shared by all ranks.
        nprocs: number of processes on this node.
        run_id: the run's id: the children check that their configuration file carries it.
        rank_body: what a forked child runs (returns its exit code); None: always start new interpreters.
    """
    import torch

    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nprocs))
    rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs),
                "LOCAL_WORLD_SIZE": str(nprocs), "NODE_RANK": "0"}
    children = _start_ranks(cfg, run_dir, nprocs, run_id, rank_body, {**rank_env, "OMP_NUM_THREADS": threads})
    shutdown = signals.current()
    if shutdown is not None:
        shutdown.children = children
    os.environ.update({**rank_env, "LOCAL_RANK": "0", "RANK": "0", "OMP_NUM_THREADS": threads})
    # OMP_NUM_THREADS is read when torch loads: rank 0's share of the cores is set here, and given back after.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    watcher = _ChildWatcher(children, run_dir)
    watcher.start()
    try:
        yield
    except BaseException as error:
        _after_rank_zero_failed(error, watcher, children, run_dir)
        raise
    finally:
        torch.set_num_threads(threads_before)
        watcher.stopped.set()
        # After a stop the checkpoint is written: what the ranks still do is teardown, not worth waiting for.
        _stop_children(children, timeout=5.0 if signals.stop_requested() else 60.0)
        if shutdown is not None:
            shutdown.children = []
    failed = [(i + 1, c.returncode) for i, c in enumerate(children) if c.returncode != 0]
    if failed and not signals.stop_requested():
        rank, code = failed[0]
        raise RuntimeError(f"rank {rank} exited with code {code}: {read_rank_error(run_dir, rank) or 'see its log'}"
                           f" (ranks that failed, with their exit codes: {failed})")


def check_rank_config() -> None:
    """In a child rank: refuse a configuration file that is not the one the launcher wrote for this run."""
    if ENV_CONFIG_SHA not in os.environ:
        return
    if "LP_PARENT_PID" in os.environ:
        signals.die_with_parent(int(os.environ["LP_PARENT_PID"]))
    config_dir = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--config-path=")), None)
    if config_dir is not None:
        verify_rank_config(Path(config_dir), os.environ[ENV_RUN_ID], os.environ[ENV_CONFIG_SHA])
