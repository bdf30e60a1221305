"""The Hugging Face coverage matrix (issue 29): a fixed sample by default, every family behind ``-m extended``.

``benchmarks.hf_coverage`` builds each causal-LM family of the installed transformers from its config class at a
tiny size, trains it 4 steps under tensor 2, pipeline 2, pipeline 2 x tensor 2 and data 2 ZeRO-2 against one
process on padded batches, and judges every cell: PARITY (every rank's loss and every final parameter within
1e-5), REFUSED before any process started, or a defect. The sample holds one family per gap the adapters
close -- fused projections (Phi-3), scalars around the block chain (Granite's embedding multiplier and logit
scaling, Cohere's logit scale), a plan naming its own blocks (GPT-NeoX), rotary bases per layer type (Gemma 3),
experts (Mixtral) -- a plain Llama, and a refusal (Granite-SWA's attention sinks under tensor parallelism).
``loss_parallel=True`` is checked on Phi-3 and OLMo2, whose fused or gathered projections crashed it.

Under AdamW (issue 43) a cell beyond the tolerance is PARITY only within 10x its family's floor under the layout's
own arithmetic (verdict tests with negative controls); the floor's loop reproduces the one-process run to the bit;
the CI sample under AdamW runs with ``-m extended``.

The pretrained columns (issue 39) are checked on a plain decoder (Llama), a tied embedding (Gemma 3) and experts
(Mixtral): a ``save_pretrained`` folder loaded with ``pretrained=`` under tensor 2 and data 2 x expert 2 equals
``from_pretrained``'s model, trains like it in one process and exports back to it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

from benchmarks.hf_coverage import CI_SAMPLE, cells, pretrained, run_matrix, table  # noqa: E402

PLAIN = tuple(layout for layout in table.COLUMNS if layout not in pretrained.COLUMNS)
PRETRAINED_SAMPLE = ("llama", "gemma3_text", "mixtral")

REFUSED = {("granite_swa", "tp2"): "local_params", ("granite_swa", "pp2xtp2"): "local_params"}
# Cells of the whole matrix known not to be PARITY or a refusal, with the cause (docs/hf-coverage.md); a new one
# fails the extended test. Gemma 4 (text and unified) is PARITY at its fp32 floor: after step 1 within 1e-6 under
# tensor 2 and data 2 ZeRO-2, after 4 steps 1.1e-5..1.2e-4 off -- and one process on half batches is 9.5e-6 and
# 4.4e-5 off itself (benchmarks/hf_coverage/floor.py).
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}  # none in the matrix of 2026-12-04


def _kinds(result: dict) -> dict[tuple[str, str], table.Verdict]:
    return {(family, layout): cell for family, cells_ in result["verdicts"].items() for layout, cell in cells_.items()}


def test_the_ci_sample_matches_one_process_or_is_refused_before_start(tmp_path):
    result = run_matrix(list(CI_SAMPLE), PLAIN, out=tmp_path / "cells", say=print)
    for (family, layout), cell in _kinds(result).items():
        if layout not in PLAIN:  # the pretrained columns: their own test below
            continue
        print(f"{family:12s} {layout:10s} {cell.short()}")
        if cell.kind == "NA":  # the family has no plan for this layout (data 2 x expert 2: no ep_plan)
            assert layout == "dp2_ep2", (family, layout)
            continue
        if (family, layout) in REFUSED:
            assert cell.kind == "REFUSED" and REFUSED[family, layout] in cell.cause, (family, layout, cell)
        else:
            assert cell.kind == "PARITY", (family, layout, cell)
            assert cell.figure <= table.TOLERANCE
    assert result["summary"]["tp2"]["families"] == len(CI_SAMPLE)  # every sample family has both plans
    page = table.markdown(result["meta"], result["matrix"], result["verdicts"], result["summary"])
    assert "| granite_swa | GraniteSWAForCausalLM | REFUSED: " in page and "PARITY 1e-05" not in page


def test_a_save_pretrained_folder_loads_trains_and_exports_like_from_pretrained_under_tp2_and_dp2_ep2(tmp_path):
    result = run_matrix(list(PRETRAINED_SAMPLE), pretrained.COLUMNS, out=tmp_path / "cells", say=print)
    for family in PRETRAINED_SAMPLE:
        for layout in pretrained.COLUMNS:
            cell = result["verdicts"][family][layout]
            print(f"{family:12s} {layout:18s} {cell.short()}")
            if layout == "pretrained_dp2_ep2" and family != "mixtral":  # no experts: no ep plan
                assert cell.kind == "NA", (family, layout, cell)
            else:
                assert cell.kind == "PARITY" and cell.figure <= table.TOLERANCE, (family, layout, cell)
    assert result["summary"]["pretrained_tp2"]["PARITY"] == 3 and result["summary"]["pretrained_dp2_ep2"]["PARITY"] == 1


def _pretrained_run(loaded: float, exported: float, first: float = 0.0, last: float = 0.0) -> dict:
    """A pretrained cell trained ``first``/``last`` off one process (:func:`_result`), whose ``w`` was loaded
    ``loaded`` off ``from_pretrained``'s and whose export is ``exported`` off the one-process model read back."""
    import torch

    return {**_result(first, last), "loaded_parameters": {"w": torch.tensor([loaded])},
            "export": {"difference": exported, "where": "w"}}


def test_a_pretrained_cell_is_parity_only_when_loaded_exactly_and_exported_within_the_tolerance():
    import torch

    reference = {**_result(0.0, 0.0), "loaded_parameters": {"w": torch.tensor([0.0])}}
    assert pretrained.verdict(None, _pretrained_run(0.0, 2e-6), reference).short() == "PARITY 2.0e-06"
    # at the fp32 floor the export may be as far from one process as the trained model is, no farther
    at_floor = pretrained.verdict(None, _pretrained_run(0.0, 7e-5, 1e-7, 8e-5), reference, floor=9.5e-6)
    assert at_floor.kind == "PARITY" and "fp32 floor" in at_floor.short()
    assert pretrained.verdict(None, _pretrained_run(0.0, 2e-4, 1e-7, 8e-5), reference, floor=9.5e-6).kind == "DEFECT"
    # negative controls: one loaded value off (even by rounding), an export off, an export that failed, nothing
    # recorded at load time, a folder transformers could not write
    assert "not from_pretrained's" in pretrained.verdict(None, _pretrained_run(1e-9, 0.0), reference).cause
    assert pretrained.verdict(None, _pretrained_run(0.0, 3e-5), reference).kind == "DEFECT"
    failed = {**_pretrained_run(0.0, 0.0), "export": {"error": "lp-convert --to hf: error: ..."}}
    assert "export failed" in pretrained.verdict(None, failed, reference).cause
    unloaded = {**_pretrained_run(0.0, 0.0), "loaded_parameters": None}
    assert pretrained.verdict(None, unloaded, reference).kind == "DEFECT"
    assert pretrained.verdict(None, {"unsaved": "OSError: ..."}, reference).kind == "DEFECT"
    assert pretrained.verdict("refused: ...", None, reference).kind == "REFUSED"


@pytest.mark.parametrize("family", ["phi3", "olmo2"])
def test_loss_parallel_trains_fused_projection_families_like_one_process(tmp_path, family):
    runs = {layout: cells.run_layout(layout, [family], tmp_path)[family] for layout in ("single", "tp2_loss_parallel")}
    cell = table.verdict(None, runs["tp2_loss_parallel"], runs["single"])
    print(family, cell.short(), runs["tp2_loss_parallel"].get("losses"))
    assert cell.kind == "PARITY", cell


@pytest.mark.extended
def test_every_family_of_the_installed_transformers(tmp_path):
    result = run_matrix(out=tmp_path / "cells", say=print, optimizers=("sgd", "adamw"))
    summary = result["summary"]
    assert summary["tp2"]["parity_share"] >= 0.9 and summary["pp2"]["parity_share"] >= 0.8, summary
    defects = {key: cell.cause for key, cell in _kinds(result).items() if cell.kind == "DEFECT"}
    assert set(defects) <= set(KNOWN_DEFECTS), {k: v for k, v in defects.items() if k not in KNOWN_DEFECTS}
    # under AdamW every cell beyond 1e-5 is within 10x its floor (2026-12-05: 19 of 427 run cells, none beyond)
    adamw_defects = {(family, layout): cell.cause for family, row in result["adamw_verdicts"].items()
                     for layout, cell in row.items() if cell.kind == "DEFECT"}
    assert not adamw_defects, adamw_defects


def _result(first: float, last: float) -> dict:
    """A run whose parameter ``w`` is ``first`` off one process after step 1 and ``last`` off at the end."""
    import torch

    return {"losses": [[1.0, 1.0, 1.0]], "parameters": {"w": torch.tensor([last])},
            "first_step_parameters": {"w": torch.tensor([first])}}


def test_a_cell_is_parity_at_the_fp32_floor_only_when_exact_after_one_step_and_the_family_drifts_itself():
    reference, drifted = _result(0.0, 0.0), _result(1e-7, 8e-5)
    assert table.verdict(None, drifted, reference).kind == "DEFECT"  # no floor measured: wrong numbers
    at_floor = table.verdict(None, drifted, reference, floor=9.5e-6)
    assert at_floor.kind == "PARITY" and "fp32 floor" in at_floor.short() and "9.5e-06" in at_floor.cause
    # negative controls: off after the first step already (a wrong gradient), or a well-conditioned family
    assert table.verdict(None, _result(3e-5, 8e-5), reference, floor=9.5e-6).kind == "DEFECT"
    assert table.verdict(None, drifted, reference, floor=7e-9).kind == "DEFECT"
    assert table.verdict(None, _result(0.0, 2e-6), reference, floor=7e-9).short() == "PARITY 2.0e-06"


# --- the matrix under AdamW (issue 43) -------------------------------------------------------------------------------

def _adamw_result(per_step: list[float]) -> dict:
    """A run whose parameter ``w`` is ``per_step[k]`` off one process after step ``k + 1``."""
    import torch

    steps = [{"w": torch.tensor([value])} for value in per_step]
    return {"losses": [[1.0] * len(per_step)], "parameters": steps[-1], "first_step_parameters": steps[0],
            "step_parameters": steps}


def test_an_adamw_cell_beyond_the_tolerance_is_parity_only_within_ten_times_its_floor_and_names_its_departure():
    from benchmarks.hf_coverage import adamw
    from benchmarks.hf_coverage.floor import Departure, Floor

    reference = _adamw_result([0.0, 0.0, 0.0])
    assert adamw.verdict(None, _adamw_result([1e-7, 2e-6, 3e-6]), reference).short() == "PARITY 3.0e-06"
    floor = Floor("pp2", 2e-5, (1e-6, 8e-6, 2e-5), Departure(3, "model.model.w", 2e-5))
    drifted = _adamw_result([1e-7, 2e-5, 5e-5])
    cell = adamw.verdict(None, drifted, reference, floor)
    assert cell.kind == "PARITY" and cell.short() == "PARITY 5.0e-05 (floor 2.0e-05)"
    assert "departs at step 2, w (2e-05)" in cell.cause and "departing at step 3, w" in cell.cause
    # negative controls: no floor measured, and a departure ten times beyond the floor (issue 43's example: 2.9e-4
    # against 4.2e-7 would be far beyond)
    assert adamw.verdict(None, drifted, reference).kind == "DEFECT"
    beyond = adamw.verdict(None, _adamw_result([1e-7, 2e-5, 2.1e-4]), reference, floor)
    assert beyond.kind == "DEFECT" and "beyond the floor" in beyond.cause
    assert adamw.verdict("refused: ...", None, reference).kind == "REFUSED"


def test_the_floor_loop_reproduces_one_process_to_the_bit_and_finds_where_a_reordered_run_departs():
    """One process: the matrix's Lightning run of a family under AdamW and the floor's plain loop on whole batches
    end equal to the bit after every step; the same loop in the pipeline's micro-batch order stays within the
    tolerance of it on Llama, and a run that departs is found at its first step."""
    from functools import partial

    from benchmarks.hf_coverage import cells
    from benchmarks.hf_coverage.arithmetic import ARITHMETIC, train_steps
    from benchmarks.hf_coverage.floor import first_departure, layout_floor

    lightning = cells.fit_module(partial(cells.TinyFamily, "llama", "adamw"), "single", 1, steps=3, every_step=True)
    whole = train_steps("llama", "adamw", ARITHMETIC["single"], steps=3)
    floor = layout_floor("llama", "pp2", "adamw", whole, lightning["step_parameters"])
    assert floor.reference_gap == 0.0
    assert floor.difference <= table.TOLERANCE and floor.departure is None, floor
    moved = [dict(params) for params in whole["step_parameters"]]
    name = next(iter(moved[1]))
    moved[1][name] = moved[1][name] + 1e-4  # a run off by 1e-4 after step 2 in one parameter
    departure = first_departure(moved, whole["step_parameters"])
    assert (departure.step, departure.parameter) == (2, name) and abs(departure.difference - 1e-4) < 1e-6


@pytest.mark.extended
def test_the_ci_sample_under_adamw_is_parity_or_at_its_floor(tmp_path):
    from benchmarks.hf_coverage import adamw

    result = run_matrix(list(CI_SAMPLE), adamw.COLUMNS, out=tmp_path / "cells", say=print, optimizers=("adamw",))
    for family, row in result["adamw_verdicts"].items():
        for layout in adamw.COLUMNS:
            cell = row[layout]
            print(f"{family:12s} {layout:10s} {cell.short()} {cell.cause}")
            if cell.kind == "NA":
                assert layout == "dp2_ep2", (family, layout)
            elif (family, layout) in REFUSED:
                assert cell.kind == "REFUSED", (family, layout, cell)
            else:
                assert cell.kind == "PARITY", (family, layout, cell)
