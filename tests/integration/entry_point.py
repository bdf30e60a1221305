"""Runs ``lp-train`` for the error-message tests.

Many cases in one process (the import is the slow part), or the installed command.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

MARK = "=== case "

HELPER = f"""
import json, sys
from lightning_parallel.cli import train
for name, args in json.loads(sys.argv[1]):
    print({MARK!r} + name, flush=True)
    sys.argv = ["lp-train", *args]
    try:
        train.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    print({MARK!r} + name + " exit " + str(code), flush=True)
"""


def entry_point_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def run_cases_in_one_process(cases, cwd):
    """``{name: (exit code, output)}`` of ``lightning_parallel.cli.train.main``.

    One entry for each ``(name, args)`` in ``cases``.
    """
    payload = json.dumps([[name, [str(a) for a in args]] for name, args in cases])
    result = subprocess.run([sys.executable, "-c", HELPER, payload], cwd=cwd, env=entry_point_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    outputs = {}
    for name, _ in cases:
        head, tail = f"{MARK}{name}\n", f"{MARK}{name} exit "
        assert tail in result.stdout, result.stdout[-3000:]
        start, end = result.stdout.index(head) + len(head), result.stdout.index(tail)
        code = result.stdout[end + len(tail):].split("\n", 1)[0]
        outputs[name] = (int(code) if code.lstrip("-").isdigit() else code, result.stdout[start:end])
    return outputs


def run_lp_train(args, cwd):
    """``(exit code, output)`` of the installed ``lp-train`` command."""
    command = [str(Path(sys.executable).parent / "lp-train"), *args]
    result = subprocess.run(command, cwd=cwd, env=entry_point_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    return result.returncode, result.stdout
