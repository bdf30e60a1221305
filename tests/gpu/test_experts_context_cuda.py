"""Mixture-of-experts and context-parallel math on one CUDA device: torch's grouped GEMM against the recipe's loop,
ring and Ulysses attention against SDPA, and the GPT MoE recipe trained on the GPU against the same run on the CPU.
Skipped without CUDA.

Run on a GPU machine with ``pytest -q -s tests/gpu/test_experts_context_cuda.py`` (one device: the context group
and the fits have one rank, so nothing is communicated; the multi-rank exchanges are checked on CPU in
``tests/distributed/parallel/`` and ``tests/distributed/strategies/test_expert_parity.py``). Each test body is a
``check_*`` function of the device, so it can also be run on ``"cpu"`` by hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.nlp.moe import loop_grouped_mm, moe_blocks
from lightning_parallel import _compat
from lightning_parallel.parallel.context import AttentionMask, context_attention, documents_from, local_positions
from lightning_parallel.parallel.experts import grouped_mm
from lightning_parallel.strategies import HybridParallelStrategy
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_recording_losses
from tests.distributed.parity_runs import padded_text_dataset, tiny_gpt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    """Full fp32 matmuls: TF32 (10-bit mantissa) would need bf16-like tolerances for the fp32 comparisons."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |value - reference| / max |reference|`` in float64 (0 for empty tensors)."""
    if reference.numel() == 0:
        return 0.0
    diff = (value.double() - reference.double()).abs().max()
    return float(diff / reference.double().abs().max().clamp_min(1e-12))


# --- 1. grouped GEMM ------------------------------------------------------------------------------------------------

# (name, rows per expert, k, n, dtypes on which the kernel must run). The kernel needs 16-byte rows of x [m, k] and
# w [G, k, n] and at least one row (grouped.kernel_fits); every other case must fall back to the loop.
GROUPED_CASES = [
    ("empty experts, unaligned counts", [5, 0, 3, 9, 0, 1], 32, 48, ("float32", "bfloat16")),
    ("all rows on one expert", [0, 0, 17, 0], 16, 32, ("float32", "bfloat16")),
    ("k=12: 48-byte fp32 rows, 24-byte bf16 rows", [4, 7, 2], 12, 16, ("float32",)),
    ("k=10: unaligned for both", [3, 3], 10, 16, ()),
    ("no rows at all", [0, 0, 0], 16, 16, ()),
]
GROUPED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to the reference's largest entry


def _grouped_run(mm, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor | None):
    """``(y, dL/dx, dL/dw)`` of ``L = sum(y * grad)``, or of ``y.sum()`` (an expanded, zero-stride gradient)."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = mm(x, weight, counts)
    (y.sum() if grad is None else (y * grad).sum()).backward()
    return y.detach(), x.grad, weight.grad


def _grouped_case(device: str, dtype: torch.dtype, counts: list[int], k: int, n: int) -> tuple[float, list[str]]:
    """The worst relative error of the suite's grouped_mm against the recipe's loop, and the paths it took."""
    generator = torch.Generator().manual_seed(sum(counts) + k + n)
    m = sum(counts)
    x = torch.randn(m, k, generator=generator).to(device, dtype)
    weight = (torch.randn(len(counts), k, n, generator=generator) / k**0.5).to(device, dtype)
    grad = torch.randn(m, n, generator=generator).to(device, dtype)
    counts_t = torch.tensor(counts, device=device)  # the recipe's counts come from a bincount on the device
    paths: list[str] = []

    def kernel(x_, w_, offsets):
        paths.append("kernel")
        return _compat.grouped_mm(x_, w_, offsets)

    worst = 0.0
    for g in (grad, None):
        mine = _grouped_run(lambda *a: grouped_mm(*a, kernel=kernel), x, weight, counts_t, g)
        reference = _grouped_run(loop_grouped_mm, x, weight, counts_t, g)
        assert all(t.dtype == dtype and t.device.type == device for t in mine)
        worst = max(worst, *(_relative_error(a, b) for a, b in zip(mine, reference)))
    return worst, paths


def check_grouped_mm(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Every GROUPED_CASES case: forward and both gradients within tolerance, on the expected path. Each case runs
    and prints its figure before any is asserted, so one GPU run reports every case."""
    errors, failures = {}, []
    for name, counts, k, n, kernel_dtypes in GROUPED_CASES:
        expected = ["kernel"] * 2 if str(dtype).removeprefix("torch.") in kernel_dtypes else []
        try:
            errors[name], paths = _grouped_case(device, dtype, counts, k, n)
        except Exception as error:  # noqa: BLE001 - a kernel refusal is reported with the other cases
            failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}")
            continue
        print(f"grouped_mm {dtype} [{name}]: {'kernel' if paths else 'loop'}, relative error {errors[name]:.2e}")
        if paths != expected:
            failures.append(f"{name}: took {paths or 'the loop'}, expected {expected or 'the loop'}")
        if errors[name] > GROUPED_TOLERANCE[dtype]:
            failures.append(f"{name}: relative error {errors[name]:.2e} > {GROUPED_TOLERANCE[dtype]}")
    assert not failures, f"grouped_mm on {device} in {dtype}: " + "; ".join(failures)
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_matches_the_recipe_loop_in_value_and_gradients(dtype):
    check_grouped_mm("cuda", dtype)


# --- 2. ring and Ulysses attention on a context group of one rank ---------------------------------------------------

BATCH, Q_HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 64, 16  # grouped-query: two query heads per kv head
ATTENTION_TOLERANCE = 2e-5  # fp32, absolute (outputs and gradients are O(1))


@contextmanager
def one_rank_group(folder: Path) -> Iterator[None]:
    """A default process group of one rank (gloo, FileStore): the attention functions read its size and rank."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; the test needs its own")
    dist.init_process_group("gloo", store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mask_cases(device: str) -> dict[str, tuple[AttentionMask, torch.Tensor]]:
    """name -> (the suite's mask, built from Hugging Face style inputs, and the reference ``[b, 1, S, S]`` bool
    visibility, built here from explicit document ids: -1 for padding)."""
    docs = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    docs[0, 20:] = 1  # row 0: two packed documents of 20 and 44 tokens
    docs[1, 30:] = 1  # row 1: documents of 30 and 21 tokens, then 13 tokens of padding
    docs[1, 51:] = -1
    valid = (docs >= 0).long()
    starts = torch.cat([torch.ones(BATCH, 1, dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], dim=1)
    offset = torch.cummax(torch.where(starts, torch.arange(SEQ), 0), dim=1).values
    position_ids = torch.arange(SEQ) - offset  # restarting at 0 at each document, as a packed batch gives them
    padding_only = valid - 1  # 0 for a token, -1 for padding: one document per row
    q, k = torch.arange(SEQ)[:, None], torch.arange(SEQ)[None, :]

    def visible(ids: torch.Tensor, rule: torch.Tensor) -> torch.Tensor:
        same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)
        return (same & rule).unsqueeze(1).to(device)

    documents = documents_from(valid.to(device), position_ids.to(device))
    assert torch.equal(documents.cpu(), docs), "documents_from disagrees with the packed layout built here"
    causal, everything = k <= q, torch.ones(SEQ, SEQ, dtype=torch.bool)
    return {
        "causal": (AttentionMask(causal=True), causal.expand(BATCH, 1, SEQ, SEQ).to(device)),
        "causal, window 8": (AttentionMask(causal=True, window=8),
                             (causal & (q - k < 8)).expand(BATCH, 1, SEQ, SEQ).to(device)),
        "causal, padding": (AttentionMask(documents=documents_from(valid.to(device), None)),
                            visible(padding_only, causal)),
        "causal, packed documents, padding": (AttentionMask(documents=documents), visible(docs, causal)),
        "bidirectional, padding": (AttentionMask(causal=False, documents=documents_from(valid.to(device), None)),
                                   visible(padding_only, everything)),
    }


def _sdpa_reference(q, k, v, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with k/v repeated per query head; a query that sees no key (padding) gets 0, the suite's convention
    (SDPA itself gives NaN there, so such rows attend to everything and are zeroed after)."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seen = allowed.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed | ~seen, scale=scale)
    return out.masked_fill(~seen, 0)


def _suite_attention(method: str, positions: torch.Tensor, mask: AttentionMask, scale: float, q, k, v):
    """The suite's entry point on a context group of one (the default group: ``group=None``)."""
    return context_attention(method, q, k, v, positions, mask, None, scale=scale)


def _attention_grads(attend, q, k, v, grad) -> list[torch.Tensor]:
    """``[out, dq, dk, dv]`` of ``sum(attend(q, k, v) * grad)``."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    (out * grad).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def check_context_attention(device: str, folder: Path) -> dict[str, float]:
    """Ring and Ulysses (context group of one) against SDPA for every mask case, forward and backward, fp32."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(BATCH, Q_HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM), (BATCH, KV_HEADS, SEQ, HEAD_DIM),
              (BATCH, Q_HEADS, SEQ, HEAD_DIM)]
    q, k, v, grad = (torch.randn(s, generator=generator).to(device) for s in shapes)
    scale = HEAD_DIM**-0.5
    errors: dict[str, float] = {}
    with one_rank_group(folder):
        positions = local_positions(SEQ, 1, 0, device=device)
        for name, (mask, allowed) in _mask_cases(device).items():
            reference = _attention_grads(partial(_sdpa_reference, allowed=allowed, scale=scale), q, k, v, grad)
            for method in ("ring", "ulysses"):
                mine = _attention_grads(partial(_suite_attention, method, positions, mask, scale), q, k, v, grad)
                assert all(t.device.type == device for t in mine)
                # NaN compares False with everything: count it as an infinite error
                diffs = [(a - b).abs().nan_to_num(float("inf")).max() for a, b in zip(mine, reference)]
                errors[f"{method} [{name}]"] = float(max(diffs))
                print(f"{method} [{name}]: max |out, dq, dk, dv - SDPA| {float(max(diffs)):.2e}")
    failures = {case: f"{error:.2e}" for case, error in errors.items() if not error <= ATTENTION_TOLERANCE}
    assert not failures, f"max |difference| over {ATTENTION_TOLERANCE} on {device}: {failures}"
    return errors


def test_ring_and_ulysses_match_sdpa_with_causal_window_padding_and_document_masks(tmp_path):
    check_context_attention("cuda", tmp_path)


# --- 3. the GPT MoE recipe on one GPU -------------------------------------------------------------------------------

# conf/model/gpt_moe.yaml's routing, on a width-64 two-block GPT (block 1 is MoE)
MOE = {"every": 2, "num_experts": 8, "top_k": 2, "router": "softmax", "capacity_factor": None, "aux_loss_weight": 0.01}
STEPS, GLOBAL_BATCH, SEQ_LEN = 8, 8, 32
LOSS_TOLERANCE = {"32-true": 1e-4, "bf16-mixed": 5e-2}  # against the CPU's fp32 losses


def _fit_moe(rank: int, world_size: int, accelerator: str, precision: str) -> dict[str, object]:
    """Rank function: 8 AdamW steps of the MoE GPT on fixed right-padded byte windows; losses and where it ran."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32, as on CPU
    pl.seed_everything(0, verbose=False)
    model = tiny_gpt(d_model=64, seq_len=SEQ_LEN, moe=MOE)
    data = padded_text_dataset(STEPS * GLOBAL_BATCH, SEQ_LEN)
    losses = fit_recording_losses(model, HybridParallelStrategy(), world_size, data, GLOBAL_BATCH, STEPS,
                                  accelerator=accelerator, precision=precision, gradient_clip_val=0.5)
    experts = moe_blocks(model)[0].experts
    return {"losses": losses, "device": str(experts.w_up.device), "experts": type(experts).__name__}


def cpu_moe_losses() -> list[float]:
    """The reference: the same fit on the CPU in fp32 (its own process, CUDA hidden)."""
    losses = run_processes(_fit_moe, 1, "cpu", "32-true", env={"CUDA_VISIBLE_DEVICES": ""})[0]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]  # it trains
    return losses


def check_moe_recipe(accelerator: str, precision: str, reference: list[float]) -> float:
    """The recipe on ``accelerator`` under ``precision``: max |loss - reference| (asserted within tolerance)."""
    run = run_processes(_fit_moe, 1, accelerator, precision)[0]
    assert run["device"].startswith(accelerator), run["device"]
    assert run["experts"] == "GroupedExperts"  # one rank: the recipe's own experts, no expert parallelism
    assert len(run["losses"]) == STEPS and all(math.isfinite(loss) for loss in run["losses"]), run["losses"]
    gap = max_abs_difference(run["losses"], reference)
    assert gap <= LOSS_TOLERANCE[precision], f"{precision} on {accelerator}: {run['losses']} vs cpu {reference}"
    return gap


@pytest.fixture(scope="module")
def cpu_reference() -> list[float]:
    return cpu_moe_losses()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gpt_moe_recipe_trains_on_one_gpu_as_on_the_cpu(cpu_reference, precision):
    gap = check_moe_recipe("cuda", precision, cpu_reference)
    if precision == "bf16-mixed":
        assert gap > 0  # bf16 really ran
    print(f"GPT MoE, {STEPS} steps, {precision}: max |loss(cuda) - loss(cpu, fp32)| {gap:.2e}")
