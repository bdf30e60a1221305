"""How lp-train starts local ranks: forked on CPU, spawned where CUDA may be in use, and a forked child's handle."""

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_parallel.cli.forked_rank import START_METHOD_ENV, ForkedRank, start_method

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")


@linux_only
def test_cpu_runs_fork_and_the_environment_can_ask_for_spawn(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert start_method("cpu") == "fork"
    assert start_method("auto") == "fork"  # this machine has no CUDA device
    assert start_method("gpu") == "spawn"  # a CUDA context does not survive a fork
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert start_method("cpu") == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    assert start_method("gpu") == "fork"  # the user's explicit choice
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="LP_START_METHOD='forkserver': use fork"):
        start_method("cpu")


@linux_only
def test_a_forked_childs_handle_polls_waits_and_kills_like_popen():
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    done = ForkedRank(pid)
    assert done.wait(timeout=30) == 3 and done.poll() == 3 and done.returncode == 3

    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    sleeping = ForkedRank(pid)
    assert sleeping.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(timeout=0.1)
    sleeping.kill()
    assert sleeping.wait(timeout=30) == -signal.SIGKILL
