"""The suite's commands (``python -m lightning_parallel.cli.<command>``) run for a test as a process of their own,
forked from the fork server that has imported torch, Lightning and the suite once per test session.

A new interpreter per command imported them again every time: 4-6 s of CPU before the command's first line, for each
of the integration tests' ~150 commands. The forked process is otherwise what ``subprocess.run`` gave: its own
working directory and environment (the test's, as given), its own stdout and stderr (captured), its exit code, a
deadline. What a fresh interpreter would read from the environment only at start-up (``PYTHONPATH``,
``OMP_NUM_THREADS`` for torch's thread pool) is applied by hand; tests of start-up itself (the installed console
script, the wheel, torchrun) keep starting interpreters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

from lightning_parallel.cli.forked_rank import exit_status
from lightning_parallel.testing import processes


def _main_of(module: str, args: list[str]) -> Optional[int]:
    """``python -m <module> *args``: its ``main()`` with ``sys.argv`` as the console script sets it (the child reads
    the exit code from what it returns)."""
    import importlib

    sys.argv = [f"lp-{module.rsplit('.', 1)[-1]}", *args]
    return importlib.import_module(module).main()


def _command_in_child(target: Callable[..., Optional[int]], args: tuple, cwd: str, env: dict[str, str], out: str,
                      err: str) -> None:
    """In the forked process: ``target(*args)`` run from ``cwd`` with ``env`` as a new interpreter would run it;
    exit with its code."""
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        # As ``python -m``: the working directory first on the path, then PYTHONPATH's entries.
        for path in reversed([cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]):
            if path not in sys.path:
                sys.path.insert(0, path)
        # One open file description when stderr joins stdout: two would each keep an offset and overwrite each other.
        opened = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, 1)
        os.close(opened)
        if err == out:
            os.dup2(1, 2)
        else:
            opened = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, 2)
            os.close(opened)
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1") or 1))
        result = target(*args)
        code = result if isinstance(result, int) else 0
    except SystemExit as done:
        code = exit_status(done)
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback on stderr, exit code 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_command(module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float,
                merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """``python -m <module> *args`` from ``cwd`` with ``env``, forked from the session's fork server.

    Args:
        module: the command's module, e.g. ``lightning_parallel.cli.train`` (its ``main()`` is called).
        args: the command line after the module.
        cwd: the working directory.
        env: the whole environment.
        timeout: seconds before the process is killed and ``subprocess.TimeoutExpired`` raised.
        merge_stderr: stderr into stdout, as ``stderr=subprocess.STDOUT`` (then ``stderr`` is None).

    Returns:
        A ``subprocess.CompletedProcess`` with text stdout and stderr, as ``subprocess.run(..., text=True)``.
    """
    args = [str(a) for a in args]
    return run_function(_main_of, (module, args), [sys.executable, "-m", module, *args], cwd, env, timeout,
                        merge_stderr)


def run_function(target: Callable[..., Optional[int]], args: tuple, command: list[str], cwd: Path,
                 env: dict[str, str], timeout: float, merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """``target(*args)`` in a process forked from the session's fork server, as :func:`run_command` runs a command.

    Args:
        target: a module-level function (the fork server unpickles it by name); its int result is the exit code.
        args: its arguments (picklable).
        command: what the result's ``args`` says was run.
        cwd, env, timeout, merge_stderr: as :func:`run_command`.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(processes.PRELOAD))  # the server is shared with the distributed tests' ranks
    with tempfile.TemporaryDirectory(prefix="lp-cli-") as folder:
        out = str(Path(folder) / "stdout")
        err = out if merge_stderr else str(Path(folder) / "stderr")
        child = ctx.Process(target=_command_in_child, args=(target, args, str(cwd), dict(env), out, err),
                            daemon=False)
        child.start()
        child.join(timeout)
        timed_out = child.is_alive()
        if timed_out:
            child.kill()
            child.join()
        stdout = Path(out).read_text(errors="replace") if Path(out).exists() else ""
        stderr = None if merge_stderr else (Path(err).read_text(errors="replace") if Path(err).exists() else "")
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, child.exitcode, stdout, stderr)


def forked_or_spawned(module: str, args: list[str], cwd: Path, env: Optional[dict[str, str]] = None,
                      timeout: float = 300) -> subprocess.CompletedProcess:
    """:func:`run_command` on Linux; elsewhere a new interpreter (``subprocess.run``), the same result."""
    env = dict(os.environ) if env is None else env
    if sys.platform.startswith("linux"):
        return run_command(module, args, cwd, env, timeout)
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
