import os

# Every test process (and the ranks it spawns) uses one thread: the machine has 2 cores
# and multi-process tests oversubscribe it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

from lightning_parallel.testing import processes  # noqa: E402

# The tests' ranks and commands are forked from one fork server per session, which imports processes.PRELOAD once.
# Many ranks here build Hugging Face models: their model stack (transformers.modeling_utils, ~0.3-0.5 s and more with
# torchao installed) is imported once there too instead of once per rank. Not in the library's PRELOAD: a user's
# session without Hugging Face models would pay for it.
# TorchRec's ranks likewise import torchrec (0.6 s) once there. Neither starts a thread or touches CUDA on import.
_SESSION_PRELOAD = {"transformers.modeling_utils": "transformers", "torchrec": "torchrec"}  # module: its package
processes.PRELOAD = (*processes.PRELOAD, *(module for module, package in _SESSION_PRELOAD.items()
                                           if importlib.util.find_spec(package) is not None))

# What Lightning writes into os.environ when a test runs a Trainer in the test process itself (a launched rank's
# coordinates). Left there, a later test's subprocess (lp-train, a README example) believes it is an already
# launched rank and waits for peers that never come: seen as `lp-train -m trainer.devices=1,2` hanging when
# tests/unit ran before tests/integration.
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE",
                     "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _launch_variables_do_not_leak_between_tests():
    saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
