"""The checks ``lp-train`` runs before it starts any rank, run in this process on a list of overrides (fast: no
subprocess, no Hydra app, no run folder), for the tests of refused configurations and of the docs' commands."""

from pathlib import Path

from lightning_parallel.cli.overrides_check import check_overrides
from lightning_parallel.cli.plan import compose
from lightning_parallel.cli.preflight import check_trainer_overrides, preflight
from lightning_parallel.cli.run_resume import resume_overrides
from lightning_parallel.cli.run_start import check_start_model, check_start_readable, start_checkpoint
from lightning_parallel.runtime.config_dir import CONFIG_DIR


def refusal(overrides: list[str], output_dir: Path) -> str:
    """The one line ``lp-train`` refuses ``overrides`` with, from the checks it runs before any rank, in its order
    (empty when every check passes).

    Args:
        overrides: the command line's ``key=value`` arguments.
        output_dir: the run folder to pretend (``paths.output_dir``; nothing is written there).
    """
    try:
        check_trainer_overrides(overrides)
        resumed = [o for o in overrides if o.startswith("resume=")]
        if resumed:
            overrides = resume_overrides(Path(resumed[0].split("=", 1)[1]), overrides)
        check_overrides(overrides, str(CONFIG_DIR))
        cfg = compose([*overrides, f"paths.output_dir={output_dir}"])
        strategy, _ = preflight(cfg)
        start = start_checkpoint(cfg)
        check_start_readable(strategy, start)
        check_start_model(cfg, start)
    except ValueError as error:  # ConfigError is one
        return str(error)
    return ""
