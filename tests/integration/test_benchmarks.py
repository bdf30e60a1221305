"""A tiny slice of the benchmark runner: one layout, one pipeline schedule, every output file written.

Times are never asserted (the machine is shared); only that the files exist with the keys the
report and docs/performance.md rely on.
"""

import csv
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runner_writes_results_csv_report_and_plots(tmp_path):
    from benchmarks.run import _quick_flag, run, settings

    assert _quick_flag(["run", "--quick", "plots=false"]) == ["run", "quick=true", "plots=false"]
    with initialize_config_dir(config_dir=str(ROOT / "benchmarks" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "quick=true", f"out_dir={tmp_path}", "date=test", "sections=[layouts,pipeline]",
            "model.seq_len=16", "model.d_model=32", "model.n_layer=2", "model.n_head=4",
            "data.max_bytes=60000", "data.train_samples=64", "data.val_samples=16", "batch_size=8",
            "quick_overrides.warmup=1", "quick_overrides.steps=2",
            "pipeline.microbatches=[4]", "quick_overrides.pipeline.steps=1",
        ])
    plain = settings(cfg)
    plain["layouts"] = {"single": plain["layouts"]["single"]}
    plain["pipeline"]["schedules"] = {"1f1b": 1}  # Hydra merges dict overrides; replace it here
    _, out = run(plain)

    assert out == tmp_path / "test"
    for name in ("results.json", "results.csv", "report.md", "step_time.png", "pipeline_timeline.png"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    assert {"meta", "layouts", "pipeline", "pipeline_timelines", "gpu"} <= set(saved)
    single = saved["layouts"]["single"]
    assert "error" not in single, single
    for key in ("trainer_ms", "raw_ms", "overhead_ms", "ratio", "target_met", "tokens_per_s", "startup_s",
                "val_loss", "raw_val_loss", "memory_per_rank", "comm_rank0"):
        assert key in single, key
    # Same init, data and optimizer: the raw loop and the Trainer learn exactly alike.
    assert single["max_loss_diff_vs_raw"] < 1e-5
    assert single["memory_per_rank"][0]["params"] == single["raw_memory_per_rank"][0]["params"]
    row = saved["pipeline"][0]
    assert row["schedule"] == "1f1b" and len(row["idle_per_rank"]) == 2
    assert row["theory"] == pytest.approx(1 / 5, abs=1e-3)
    assert all(b > 0 for b in row["peak_activation_bytes"])
    with (out / "results.csv").open() as f:
        assert next(csv.DictReader(f))["layout"] == "single"
    report = (out / "report.md").read_text()
    for heading in ("## 1. Strategy overhead", "## 3. Pipeline", "## 5. Communication", "## 7. Start-up"):
        assert heading in report


def test_missing_matplotlib_skips_the_plots_and_writes_everything_else(tmp_path, monkeypatch, capsys):
    import sys

    from benchmarks.report import write_all

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    results = {"meta": {"date": "test", "command": "python -m benchmarks.run --quick", "machine": "cpu",
                        "torch": "x", "lightning": "x", "deepspeed": "x", "runtime_s": 0.0, "quick": True,
                        "commit": "x", "model": {}, "batch_size": 1, "steps": 1, "warmup": 0},
               "gpu": {"note": "Not run"}}
    written = write_all(tmp_path, results, plots=True)

    assert [p.name for p in written] == ["results.json", "results.csv", "report.md"]
    assert all(p.is_file() for p in written)
    out = capsys.readouterr().out
    assert out.count("pip install -e '.[bench]'") == 1 and "plots skipped" in out
