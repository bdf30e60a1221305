"""FP8 (``float8``, torchao's emulation on CPU) under sharded layouts trains as one process in FP8 does.

The GPT recipe (width 32, 2 blocks; the MoE recipe for data 2 x expert 2), AdamW, clipping 0.5, padded byte windows,
8 steps; losses of every step compared with one process in FP8 on the same global batches.

* Rowwise scales are per row, so no split of a layout changes them: in fp32 (``32-true``, FP8 only in the converted
  matmuls) every layout gives one process's losses up to summation order (measured <= 3.6e-5; tolerance 1e-3), while the
  same layout without FP8 is 1.3e-2 away -- the negative control: FP8 silently dropped on a layout is caught.
* Tensorwise scales of activations and output gradients are the amax of the tensor a rank holds, so data parallelism
  and pipeline micro-batches compute other (equally valid) scales than one process over its whole batch, as on GPUs.
  Such a run is held to the issue's bound under ``bf16-mixed``: within the gap between one process in FP8 and one
  process in bf16, measured in the same run. (In fp32 data 2 ZeRO 3 tensorwise exceeds the fp32 gap: 1.7e-2 vs 1.2e-2;
  docs/float8.md.)
"""

import importlib.util

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import run_processes

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                 reason="FP8 needs torchao: pip install 'lightning-parallel[float8]'")]

STEPS, GLOBAL_BATCH, ROWWISE_TOL = 8, 8, 1e-3
MOE = {"every": 2, "num_experts": 4, "top_k": 2, "aux_loss_weight": 0.05}
LAYOUTS = {  # name: (options, data-parallel size, world size, MoE)
    "data 2 (ZeRO 3)": (dict(data_parallel_size=2, zero_stage=3), 2, 2, None),
    "tensor 2": (dict(data_parallel_size=1, tensor_parallel_size=2), 1, 2, None),
    "data 2 x expert 2 (MoE)": (dict(data_parallel_size=2, expert_parallel_size=2), 2, 2, MOE),
    "pipeline 2 x tensor 2": (dict(data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=2), 1, 4, None),
}


def _fit(rank, world_size, cases):
    """``{name: losses}`` of each ``name: (options, data_parallel, precision, moe)`` fitted in these processes."""
    from lightning_parallel.testing.fit import fit_recording_losses
    from tests.distributed.parity_runs import padded_text_dataset, tiny_gpt

    return {name: fit_recording_losses(tiny_gpt(**({"moe": moe} if moe else {})), Hybrid(**options), world_size,
                                       padded_text_dataset(256, 16), GLOBAL_BATCH // dp, STEPS, precision=precision,
                                       gradient_clip_val=0.5)
            for name, (options, dp, precision, moe) in cases.items()}


def _worst(losses, reference):
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def _one_process(precision, recipes, moe):
    return {recipe: (dict(data_parallel_size=1, float8=recipe), 1, precision, moe) for recipe in recipes}


def test_rowwise_fp8_under_zero3_gives_one_process_losses_and_fp8_dropped_is_caught():
    one = run_processes(_fit, 1, _one_process("32-true", ["rowwise"], None), timeout=600)[0]
    zero3 = dict(data_parallel_size=2, zero_stage=3)
    got = run_processes(_fit, 2, {"fp8": ({**zero3, "float8": "rowwise"}, 2, "32-true", None),
                                  "no fp8": (zero3, 2, "32-true", None)}, timeout=600)[0]
    worst, control = _worst(got["fp8"], one["rowwise"]), _worst(got["no fp8"], one["rowwise"])
    print(f"ZeRO 3 rowwise vs one process {worst:.2e}; without FP8 {control:.2e}")
    assert worst < ROWWISE_TOL < control


@pytest.fixture(scope="module")
def one_process():
    cases = {}
    for kind, moe in (("dense", None), ("moe", MOE)):
        for precision in ("bf16-mixed", "32-true"):
            recipes = [None, "tensorwise", "rowwise"] if precision == "bf16-mixed" else ["rowwise"]
            cases.update({(kind, precision, recipe): case
                          for recipe, case in _one_process(precision, recipes, moe).items()})
    return run_processes(_fit, 1, cases, timeout=900)[0]


def _layout_cases(world_size):
    cases = {}
    for name, (options, dp, world, moe) in LAYOUTS.items():
        if world == world_size:
            for precision, recipes in (("bf16-mixed", ("tensorwise", "rowwise")), ("32-true", ("rowwise",))):
                cases.update({(name, precision, r): ({**options, "float8": r}, dp, precision, moe) for r in recipes})
    return cases


@pytest.mark.extended  # 20 fits on 2 and 4 ranks; the ZeRO 3 rowwise case above runs by default
@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_under_every_layout_stays_within_the_fp8_vs_bf16_gap(one_process, world_size):
    got = run_processes(_fit, world_size, _layout_cases(world_size), timeout=1200)[0]
    for (name, precision, recipe), losses in got.items():
        kind = "moe" if LAYOUTS[name][3] else "dense"
        reference = one_process[(kind, precision, recipe)]
        worst = _worst(losses, reference)
        if precision == "32-true":
            print(f"{name} {recipe} fp32: {worst:.2e} (tolerance {ROWWISE_TOL})")
            assert worst < ROWWISE_TOL, (name, recipe, worst)
        else:
            gap = _worst(reference, one_process[(kind, precision, None)])
            print(f"{name} {recipe} bf16-mixed: {worst:.2e} within the one-process FP8-vs-bf16 gap {gap:.2e}")
            assert worst < gap, (name, recipe, worst, gap)


@pytest.mark.extended
def test_fp8_all_gather_gives_the_losses_of_a_high_precision_gather():
    """The FP8 all-gather casts each shard with the whole weight's scale: the same FP8 weight as gathering in high
    precision and casting after (scales precomputed after each step in one all-reduce)."""
    zero3 = dict(data_parallel_size=2, zero_stage=3, float8="tensorwise")
    got = run_processes(_fit, 2, {flag: ({**zero3, "float8_all_gather": flag}, 2, "32-true", None)
                                  for flag in (True, False)}, timeout=600)[0]
    assert _worst(got[True], got[False]) < 1e-5
