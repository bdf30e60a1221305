"""``lp-compare`` with layouts spelled by their sizes: context-parallel layouts of the GPT recipe match one process."""

import pytest

from tests.integration.test_lp_compare import TINY, _compare

pytestmark = pytest.mark.slow


def test_context_layouts_spelled_by_sizes_match_one_process(tmp_path):
    layouts = "compare.layouts=[single:1,cp2,cp2:ulysses]"
    code, out = _compare([*TINY, layouts, "compare.steps=4"], tmp_path)
    assert code == 0, out[-6000:]
    assert "lp-compare: all 3 layouts agree within 1e-05" in out
    for label in ("dp1xcp2xpp1xtp1:ring", "dp1xcp2xpp1xtp1:ulysses"):
        assert f"Δloss {label}" in out
    assert "DIFFERS" not in out
