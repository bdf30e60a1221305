"""bf16 under every strategy: as close to one process in the same precision as that process is to fp32,
and the gradient reductions over the tensor axis in fp32.

Parity: the bound is measured in the same test, the one-process run's own bf16-vs-fp32
difference on the same model, data and steps. A layout that reduced gradients in the wrong
dtype, dropped autocast, or mis-scaled a gradient would leave it (the negative control shows
the bound is tight enough to catch a gradient scale error).

Tensor axis: a tiny GPT under sequence parallelism (tensor size 2) keeps its norms whole on
every tensor rank; their gradients are partial sums all-reduced over the tensor axis. With
FSDP2 on the data axis, torch applies ``MixedPrecisionPolicy.reduce_dtype`` to its own
reduce-scatter only, and that all-reduce runs in ``param_dtype`` (pytorch#190626). The suite
keeps FSDP2's parameters fp32 with tensor parallelism (autocast still computes in bf16), so
the all-reduce is fp32; the negative control builds torchtitan's policy (bf16 parameters,
fp32 reduction) by hand on the same layout and catches the bf16 all-reduce. Both checks share
one 2-process launch (starting processes is most of the cost here).
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.layout import DATA_PARALLEL, TENSOR_PARALLEL, ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import BuildSettings, parallelize
from lightning_parallel.parallel.data import shard_data_axis
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel, concrete_plan
from lightning_parallel.strategies import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy
from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parallel.tp_runs import batches, tiny_gpt
from tests.distributed.parity_runs import fit_cases

pytestmark = pytest.mark.slow

# Per precision, a setting where its bf16 error is well above loss rounding: bf16-true's losses are
# bf16 numbers (steps of 2^-9 near 0.5), so it runs SGD, whose bf16 weights drift visibly from fp32.
SETTINGS = {
    "bf16-mixed": dict(optimizer="adamw", steps=16, clip=0.5),
    "bf16-true": dict(optimizer="sgd", steps=8, clip=0.5),
    "unclipped": dict(optimizer="sgd", steps=8, clip=None),
}


class SumLossPipeline(PipelineParallelStrategy):
    """A deliberately broken pipeline: micro-batch gradients are summed, not averaged (negative control)."""

    def setup(self, trainer):
        super().setup(trainer)
        self.pipeline_runner.microbatch_scale = 1.0


def _case(strategy, data_parallel: int, precision: str, setting: str = "") -> dict:
    s = SETTINGS[setting or precision]
    kwargs = {"precision": precision, **({"gradient_clip_val": s["clip"]} if s["clip"] else {})}
    return dict(strategy=strategy, global_batch=16, data_parallel=data_parallel, optimizer=s["optimizer"],
                steps=s["steps"], trainer_kwargs=kwargs)


def _references(settings) -> dict[str, list[float]]:
    """One process (Lightning's single-device strategy) per setting, in its precision and in fp32."""
    cases = {}
    for setting, precision in settings:
        cases[f"{setting}/{precision}"] = _case("auto", 1, precision, setting)
        cases[f"{setting}/32-true"] = _case("auto", 1, "32-true", setting)
    return run_processes(fit_cases, 1, cases)[0]


def _check(per_rank: list[dict], reference: dict, name: str) -> tuple[float, float]:
    """(worst difference over ranks to one process in the case's precision, that process's own bf16 error).

    Case names are ``layout/setting/precision``.
    """
    _, setting, precision = name.split("/")
    bound = max_abs_difference(reference[f"{setting}/{precision}"], reference[f"{setting}/32-true"])
    worst = max(max_abs_difference(results[name], reference[f"{setting}/{precision}"]) for results in per_rank)
    return worst, bound


def _deepspeed_bf16_true(per_rank: list[dict], reference: dict, name: str) -> tuple[float, float]:
    """DeepSpeed's bf16 keeps fp32 master weights, which Lightning's one-process bf16-true does not have:
    it must be at least as close to fp32 as that process (difference to fp32, the process's own bf16 error)."""
    _, setting, precision = name.split("/")
    fp32 = reference[f"{setting}/32-true"]
    bound = max_abs_difference(reference[f"{setting}/{precision}"], fp32)
    return max(max_abs_difference(results[name], fp32) for results in per_rank), bound


def _assert_within(per_rank: list[dict], reference: dict, names) -> None:
    found = {}
    for name in names:
        check = _deepspeed_bf16_true if name.startswith("deepspeed") and name.endswith("bf16-true") else _check
        found[name] = check(per_rank, reference, name)
    print("\n".join(f"{name}: {worst:.3g} (bound {bound:.3g})" for name, (worst, bound) in found.items()))
    for name, (worst, bound) in found.items():
        assert worst <= bound, f"{name}: {worst:.3g} from one process, whose own bf16 error is {bound:.3g}"


def _cases(layouts: dict, precisions=("bf16-mixed", "bf16-true")) -> dict:
    return {
        f"{layout}/{p}/{p}": _case(strategy, dp, p) for layout, (strategy, dp) in layouts.items() for p in precisions
    }


ALL_REDUCES = ("all_reduce", "allreduce")


class RecordReductions(TorchDispatchMode):
    """Records ``(dtype, shape)`` of every all-reduce dispatched inside (functional and c10d collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in func.__name__ for name in ALL_REDUCES):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.seen.extend((t.dtype, tuple(t.shape)) for t in tensors if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _norm_gradient_reductions(rank: int, world_size: int, meshes, hand_built_policy: bool) -> dict:
    """One bf16-autocast step of a sequence-parallel GPT on dp1 x tp2 under FSDP2 (zero_stage=2)."""
    mesh = meshes.run
    module = copy.deepcopy(tiny_gpt())
    norm_shape = tuple(module.head.norm.weight.shape)
    if hand_built_policy:  # torchtitan's policy, which the suite refuses with tensor parallelism
        from torch.distributed.fsdp import MixedPrecisionPolicy

        adapter = adapt(module)
        plan = concrete_plan(module, None, sequence_parallel=True, adapter=adapter)
        apply_tensor_parallel(module, mesh[TENSOR_PARALLEL], plan, adapter)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_data_axis(list(module.pipeline_layers()), [module], mesh[DATA_PARALLEL], 2, policy)
    else:
        options = ParallelOptions(1, 1, world_size, zero_stage=2, sequence_parallel=True)
        parallelize(module, meshes=meshes, options=options, adapter=adapt(module),
                    build=BuildSettings(precision="bf16-mixed"))
    inputs, targets = batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module.pipeline_loss(module(inputs), targets)
    recorder = RecordReductions()
    with recorder:
        loss.backward()
    # 1-D reductions are the norms' weight and bias gradients; activation gradients are 3-D.
    return {"norm_grads": sorted({str(d) for d, shape in recorder.seen if shape == norm_shape}),
            "norm_grad_dtype": str(module.head.norm.weight.grad.dtype)}


def _both(rank: int, world_size: int) -> dict:
    meshes = RunMeshes.build(ParallelLayout(world_size, 1, 1, world_size), "cpu", 2)
    return {name: _norm_gradient_reductions(rank, world_size, meshes, hand_built)
            for name, hand_built in (("suite", False), ("torchtitan_policy", True))}


def _fit_and_check_reductions(rank: int, world_size: int, cases: dict) -> dict:
    return {"fits": fit_cases(rank, world_size, cases), "reductions": _both(rank, world_size)}


@pytest.fixture(scope="module")
def two_process_run() -> tuple[dict, list[dict]]:
    cases = _cases({
        "pipeline": (partial(PipelineParallelStrategy, pipeline_parallel_size=2), 1),
        "tensor": (partial(TensorParallelStrategy, tensor_parallel_size=2), 1),
        "dp2": (partial(HybridParallelStrategy, zero_stage=0), 2),
        "dp2_zero3": (partial(HybridParallelStrategy, zero_stage=3), 2),
        "deepspeed_zero2": (partial(DeepSpeedDataParallelStrategy, zero_stage=2), 2),
    })
    cases["broken_pipeline/unclipped/bf16-mixed"] = _case(SumLossPipeline, 1, "bf16-mixed", "unclipped")
    return cases, run_processes(_fit_and_check_reductions, 2, cases, timeout=900)


def test_two_process_strategies_in_bf16_match_one_process_within_its_bf16_error(two_process_run):
    cases, results = two_process_run
    per_rank = [r["fits"] for r in results]
    reference = _references([("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"), ("unclipped", "bf16-mixed")])
    for setting in ("bf16-mixed", "bf16-true"):  # bf16 really ran: one process in bf16 is not fp32
        assert max_abs_difference(reference[f"{setting}/{setting}"], reference[f"{setting}/32-true"]) > 1e-4
    _assert_within(per_rank, reference, [n for n in cases if not n.startswith("broken")])
    # Negative control: a gradient scale error (micro-batch losses summed, 4x) is far outside the bound.
    worst, bound = _check(per_rank, reference, "broken_pipeline/unclipped/bf16-mixed")
    assert worst > 10 * bound


def test_tensor_axis_gradient_reduction_is_fp32_under_bf16_mixed_and_the_policy_it_avoids_is_not(two_process_run):
    for result in (r["reductions"] for r in two_process_run[1]):
        assert result["suite"]["norm_grads"] == ["torch.float32"], result
        assert result["suite"]["norm_grad_dtype"] == "torch.float32"  # fp32 master weights
        # Negative control: with bf16 FSDP2 parameters the same all-reduce runs in bf16, reduce_dtype notwithstanding.
        assert "torch.bfloat16" in result["torchtitan_policy"]["norm_grads"], result


@pytest.mark.extended
def test_four_process_layouts_in_bf16_match_one_process_within_its_bf16_error():
    cases = _cases({
        "dp2xpp2_zero3": (partial(HybridParallelStrategy, pipeline_parallel_size=2, zero_stage=3), 2),
        "pp2xtp2": (partial(HybridParallelStrategy, pipeline_parallel_size=2, tensor_parallel_size=2), 1),
        "dp2xtp2_zero2": (partial(HybridParallelStrategy, tensor_parallel_size=2, zero_stage=2), 2),
        "deepspeed_zero3": (partial(DeepSpeedDataParallelStrategy, zero_stage=3), 4),
    })
    per_rank = run_processes(fit_cases, 4, cases, timeout=1500)
    _assert_within(per_rank, _references([("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true")]), list(cases))
