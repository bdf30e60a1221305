"""Runs ``lp-train`` for the error-message tests.

Many cases in one process forked from the session's fork server (the import is the slow part), one ``lp-train``
forked the same way, or the installed command (a new interpreter: what a user's shell runs, import-time output
included).
"""

import os
import subprocess
import sys
from pathlib import Path

MARK = "=== case "


def _cases(cases: list[tuple[str, list[str]]]) -> int:
    """In the forked process: ``lp-train`` for each case in turn, its output between two marks."""
    from lightning_parallel.cli import train

    for name, args in cases:
        print(MARK + name, flush=True)
        sys.argv = ["lp-train", *args]
        try:
            train.main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        print(f"{MARK}{name} exit {code}", flush=True)
    return 0


def entry_point_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}


def run_cases_in_one_process(cases, cwd):
    """``{name: (exit code, output)}`` of ``lightning_parallel.cli.train.main``.

    One entry for each ``(name, args)`` in ``cases``.
    """
    from tests.integration.forked_cli import run_function

    cases = [(name, [str(a) for a in args]) for name, args in cases]
    result = run_function(_cases, (cases,), ["lp-train", "(cases)"], cwd, entry_point_env(), 300, merge_stderr=True)
    outputs = {}
    for name, _ in cases:
        head, tail = f"{MARK}{name}\n", f"{MARK}{name} exit "
        assert tail in result.stdout, result.stdout[-3000:]
        start, end = result.stdout.index(head) + len(head), result.stdout.index(tail)
        code = result.stdout[end + len(tail):].split("\n", 1)[0]
        outputs[name] = (int(code) if code.lstrip("-").isdigit() else code, result.stdout[start:end])
    return outputs


def run_lp_train_forked(args, cwd):
    """``(exit code, output)`` of ``lp-train`` forked from the fork server (stdout and stderr together)."""
    from tests.integration.forked_cli import run_command

    result = run_command("lightning_parallel.cli.train", list(args), cwd, entry_point_env(), 300, merge_stderr=True)
    return result.returncode, result.stdout


def run_lp_train(args, cwd):
    """``(exit code, output)`` of the installed ``lp-train`` command."""
    command = [str(Path(sys.executable).parent / "lp-train"), *args]
    result = subprocess.run(command, cwd=cwd, env=entry_point_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=300)
    return result.returncode, result.stdout
