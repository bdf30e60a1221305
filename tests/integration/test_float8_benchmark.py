"""The GPU step of ``benchmarks/gpu.sh float8`` (``benchmarks/float8_mfu.py``) runs its whole path on CPU as a dry run:
a tiny Llama from a config in bf16 eager, bf16 compiled, FP8 tensorwise and rowwise, results written as on a GPU."""

import importlib.util
import json

import pytest

from benchmarks import float8_mfu


def test_peaks_and_flops_follow_the_device_and_the_model():
    assert float8_mfu.peaks_of("NVIDIA H100 80GB HBM3") == (989e12, 1979e12)
    assert float8_mfu.peaks_of("NVIDIA H100 PCIe") == (756e12, 1513e12)
    assert float8_mfu.peaks_of("NVIDIA A100-SXM4-80GB") == (312e12, None)
    assert float8_mfu.peaks_of("some other device") == (None, None)
    # 6 x non-embedding parameters + 12 x layers x width x sequence
    assert float8_mfu.flops_per_token(1000, 100, 2, 8, 4) == 6 * 900 + 12 * 2 * 8 * 4


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="FP8 needs torchao")
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the Llama needs transformers")
def test_dry_run_trains_every_variant_and_writes_the_results(tmp_path):
    result = float8_mfu.main(["--dry-run", "--out", str(tmp_path)])
    rows = {row["variant"]: row for row in result["rows"]}
    assert set(rows) == set(float8_mfu.VARIANTS) and not any("error" in row for row in rows.values()), rows
    assert rows["bf16_eager"]["fp8_layers"] == 0 and rows["fp8_tensorwise"]["fp8_layers"] == 14
    assert rows["fp8_rowwise"]["fp8_layers"] == 14 and rows["fp8_rowwise"]["model"] == "llama"
    # Same weights and batches: the first losses differ by FP8's rounding only.
    assert abs(rows["fp8_tensorwise"]["first_loss"] - rows["bf16_eager"]["first_loss"]) < 0.05
    assert all(row["tokens_per_s"] > 0 and row["mfu_bf16_peak"] is None for row in rows.values())  # no CPU peak
    saved = json.loads((tmp_path / "float8_mfu_dry_run.json").read_text())
    assert saved["meta"]["dry_run"] and len(saved["rows"]) == 4
    assert "| fp8_rowwise |" in (tmp_path / "float8_mfu_dry_run.md").read_text()
