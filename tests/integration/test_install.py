"""Installed like a library: the wheel carries the configs and recipes inside ``lightning_parallel``, ``lp-train``
runs from any folder, and a user's own configs join the suite's groups (docs/configs.md "Your own configs").

The wheel is built offline from a copy of the checkout (no build isolation, no index), installed with
``pip install --target`` and imported through ``PYTHONPATH`` from a folder outside the checkout, so the
runs below use the installed copy, never the source tree. The user-config example is read from docs/configs.md
(its files and both commands), so the docs show what this test runs.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "lightning_parallel", "lightning_parallel_pytest", "conf", "examples")
TINY = ["model=gpt_tiny", "trainer=cpu_test", "trainer.max_steps=5", "trainer.accelerator=cpu", "logger=none",
        "data.seq_len=32", "data.batch_size=4", "data.max_bytes=200000"]


def _readme_example() -> tuple[dict[str, str], list[list[str]]]:
    """docs/configs.md's "Your own configs" example: its files (path -> text) and its commands' arguments."""
    readme = (ROOT / "docs" / "configs.md").read_text()
    section = readme.split("\n## Your own configs\n", 1)[1].split("\n## ", 1)[0]
    files = dict(re.findall(r"^`([\w/.]+\.(?:py|yaml))`:\n\n```\w+\n(.*?)^```", section, flags=re.M | re.S))
    commands = [shlex.split(line)[2:] for line in section.splitlines() if line.startswith("PYTHONPATH=. lp-train ")]
    return files, commands


USER_FILES, USER_COMMANDS = _readme_example()


def _env(*pythonpath: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
            "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}


def _run(command: list, cwd: Path, env: dict, timeout: int = 300) -> str:
    result = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline from a copy of the checkout (its build/ and egg-info untouched)."""
    src, dist = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", dist, src], cwd=src, env=_env())
    (built,) = dist.glob("lightning_parallel-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (``lp-train`` lands in its ``bin/``)."""
    target = tmp_path_factory.mktemp("site")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
          "--target", target, wheel], cwd=target, env=_env())
    return target


def test_wheel_carries_configs_and_recipes_inside_the_package_and_nothing_top_level(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {name.split("/")[0] for name in names}
    assert top == {"lightning_parallel", "lightning_parallel_pytest", "lightning_parallel-0.1.0.dist-info"}
    # Every config, recipe and module of the checkout is in the wheel (a subpackage missing from
    # pyproject.toml's package list would be left out silently).
    expected = {f"lightning_parallel/conf/{p.relative_to(ROOT / 'conf').as_posix()}"
                for p in (ROOT / "conf").rglob("*.yaml")}
    expected |= {f"lightning_parallel/examples/{p.relative_to(ROOT / 'examples').as_posix()}"
                 for p in (ROOT / "examples").rglob("*.py")}
    expected |= {p.relative_to(ROOT).as_posix() for d in ("lightning_parallel", "lightning_parallel_pytest")
                 for p in (ROOT / d).rglob("*.py")}
    assert "lightning_parallel/conf/config.yaml" in expected
    assert sorted(expected - names) == []


def test_installed_lp_train_trains_from_a_folder_outside_the_checkout(site, tmp_path):
    env = _env(site)
    where = _run([sys.executable, "-c",
                  "import lightning_parallel.examples.nlp.model as m, lightning_parallel.cli.train as t;"
                  "print(m.__file__); print(t.CONFIG_DIR)"], cwd=tmp_path, env=env)
    assert all(line.startswith(str(site)) for line in where.split()), where
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == [
        "bin", "lightning_parallel", "lightning_parallel_pytest"]

    out = _run([site / "bin" / "lp-train", *TINY, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert "lightning_parallel: result" in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert "train_loss" in metrics["metrics"]
    hydra = yaml.safe_load((tmp_path / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    sources = hydra["runtime"]["config_sources"]
    main = next(s for s in sources if s["provider"] == "main")
    assert main["path"] == str(site / "lightning_parallel" / "conf")


def test_readme_example_has_the_files_and_both_ways_to_add_a_config_folder():
    assert sorted(USER_FILES) == ["configs/data/sums.yaml", "configs/experiment/my_study.yaml",
                                  "configs/model/regressor.yaml", "my_model.py"]
    assert [args[0].split("=")[0] for args in USER_COMMANDS] == ["--config-dir", "hydra.searchpath"]


@pytest.mark.parametrize("args", USER_COMMANDS, ids=lambda args: args[0].split("=")[0].lstrip("-"))
def test_users_own_configs_join_the_suites_groups(site, tmp_path, args):
    """The docs' example, run as written (shortened: 2 steps, 1 CPU device) from a project folder."""
    project = tmp_path / "my_project"
    for name, text in USER_FILES.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)

    short = ["trainer.max_steps=2", "trainer.devices=1", "trainer.accelerator=cpu", "trainer.val_check_interval=2",
             "trainer.enable_progress_bar=false", f"hydra.run.dir={project / 'run'}"]
    out = _run([site / "bin" / "lp-train", *args, *short], cwd=project, env=_env(site, "."))
    assert "lightning_parallel: result" in out
    metrics = json.loads((project / "run" / "metrics.json").read_text())
    chosen = dict(a.split("=", 1) for a in args if a.startswith("strategy="))
    assert metrics["experiment"] == "my_study" and metrics["strategy"] == chosen.get("strategy", "ddp")
    assert "val_loss" in metrics["metrics"] and "train_loss" in metrics["metrics"]
    effective = yaml.safe_load((project / "run" / ".hydra" / "effective.yaml").read_text())
    assert effective["model"]["_target_"] == "my_model.Regressor"
    assert effective["data"]["_target_"] == "my_model.SumData"
