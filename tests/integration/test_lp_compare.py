"""``lp-compare`` end to end: the GPT recipe under four layouts matches one process; an injected bug does not."""

import os
from pathlib import Path

import pytest

from tests.integration.forked_cli import forked_or_spawned

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = ["experiment=nlp_gpt", "model=gpt_tiny", "data.seq_len=16", "data.max_bytes=200000"]


def _compare(args, tmp_path, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}
    result = forked_or_spawned("lightning_parallel.cli.compare", [*args, f"hydra.run.dir={tmp_path}/run"], tmp_path,
                               env, timeout)
    return result.returncode, result.stdout + result.stderr


def test_gpt_recipe_matches_one_process_under_pipeline_tensor_and_hybrid(tmp_path):
    code, out = _compare(
        [*TINY, "compare.layouts=[single:1,pipeline:2,tensor:2,hybrid:4]", "compare.steps=10"], tmp_path
    )
    assert code == 0, out[-6000:]
    assert "lp-compare: all 4 layouts agree within 1e-05" in out
    for layout in ("pipeline:2", "tensor:2", "hybrid:4"):
        assert f"Δloss {layout}" in out and f"Δgnorm {layout}" in out
    assert out.count("match") >= 3 and "DIFFERS" not in out


def _summary_rows(out):
    return {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│ ") and ":2 " in line}


def test_summed_microbatch_losses_are_reported_with_exit_code_1_and_traced_to_the_head(tmp_path):
    bug = "model._target_=tests.integration.compare_models.SummedMicrobatchGPT"
    args = [*TINY, bug, "compare.layouts=[single:1,pipeline:2,tensor:2]", "compare.steps=3", "compare.trace=true"]
    code, out = _compare(args, tmp_path)
    assert code == 1, out[-6000:]
    assert "lp-compare: pipeline:2 first differs at step 0: |Δloss|" in out
    rows = _summary_rows(out)
    assert "DIFFERS" in rows["pipeline:2"] and "match" in rows["tensor:2"]
    # Forward outputs match; the gradient goes wrong at the last module, 4x (= micro-batches) too large.
    assert "lp-compare trace: step 0, pipeline:2: first differing module 'head" in out
    assert "(gradient," in out and "gradient norm ratio 4.0000" in out


@pytest.mark.extended  # ~40 s; the summed-micro-batch test covers tracing in the default run
def test_an_unsynchronised_norm_weight_under_sequence_parallel_is_traced_to_that_norm(tmp_path):
    bug = "model._target_=tests.integration.compare_models.UnsyncedNormGPT"
    args = [*TINY, bug, "strategy.sequence_parallel=true", "compare.layouts=[single:1,tensor:2]", "compare.steps=3",
            "compare.trace=true"]
    code, out = _compare(args, tmp_path)
    assert code == 1, out[-6000:]
    # The losses still agree: the gradient norm and the parameters give it away.
    assert "lp-compare: tensor:2 first differs at step 0: |Δgrad norm|" in out
    assert "ln2." in _summary_rows(out)["tensor:2"]
    assert "lp-compare trace: step 0, tensor:2: first differing module 'blocks.1.ln2' (gradient" in out


def test_a_malformed_layout_is_a_config_error(tmp_path):
    code, out = _compare([*TINY, "compare.layouts=[single:1,pipeline]"], tmp_path, timeout=300)
    assert code == 2 and "lp-compare: error: compare.layouts entry 'pipeline' is not NAME:DEVICES" in out, out[-3000:]


@pytest.mark.extended  # ~60 s: three layouts plus an fp32 reference launch
def test_bf16_derives_its_tolerance_from_the_reference_and_passes_on_an_honest_model(tmp_path):
    args = [*TINY, "trainer.precision=bf16-mixed", "compare.tolerance=auto", "compare.layouts=[single:1,pipeline:2]",
            "compare.steps=5"]
    code, out = _compare(args, tmp_path)
    assert code == 0, out[-6000:]
    assert "= 2 x the largest difference of single:1 at precision bf16-mixed from fp32" in out
    assert "lp-compare: all 2 layouts agree within" in out
