"""``lp-plan`` end to end on the shipped configs: the ranked table, the refusals and a pasteable override line."""

from __future__ import annotations

import sys

from tests.integration.entry_point import entry_point_env
from tests.integration.forked_cli import forked_or_spawned


def test_lp_plan_prints_a_ranking_and_an_override_line_lp_train_composes(tmp_path) -> None:
    command = [sys.executable, "-m", "lightning_parallel.cli.plan", "model=gpt_tiny", "trainer.devices=4",
               "data.seq_len=32", "data.max_bytes=20000", "--cluster", "cpu", "--top", "5"]
    done = forked_or_spawned(command[2], command[3:], tmp_path, entry_point_env(), 300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "lp-plan: GPT on 4 x cpu" in out and "refused layouts" in out
    assert "too few layers" in out  # 4 pipeline layers cannot fill pp4 x 2 stages per rank
    line = out.rsplit("lp-train ", 1)[1].split()
    assert "trainer.devices=4" in line

    from lightning_parallel.cli.plan import compose

    cfg = compose(["model=gpt_tiny", *line])  # the line is valid Hydra overrides of the shipped configs
    assert cfg.trainer.devices == 4 and "_target_" in cfg.strategy


def test_lp_plan_refuses_a_bad_cluster_in_one_line(tmp_path) -> None:
    command = [sys.executable, "-m", "lightning_parallel.cli.plan", "model=gpt_tiny", "--cluster", "nowhere"]
    done = forked_or_spawned(command[2], command[3:], tmp_path, entry_point_env(), 300)
    assert done.returncode == 2
    assert done.stderr.startswith("lp-plan: error: No cluster description 'nowhere'") and "h100_node" in done.stderr
