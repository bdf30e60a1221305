"""Context parallelism on the GPT recipe: every layout with a context axis gives one process's losses.

fp32, AdamW, gradient clipping, 8 steps, byte windows right-padded to unequal lengths (``-100``
targets), so the loss is the global batch's token mean only if every rank's share of every sequence is
weighted by the global token count. Both methods (ring, all-to-all) under cp 2 and cp 4, and composed with
data, pipeline and tensor parallelism.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import fit_cases, tiny_gpt
from tests.distributed.strategies.parity import assert_parity, reference_losses

pytestmark = pytest.mark.slow

CLIP = {"gradient_clip_val": 0.5}


def _gpt(data_parallel=1, **options):
    return dict(strategy=partial(Hybrid, **options), global_batch=8, data_parallel=data_parallel, steps=8,
                model_factory=tiny_gpt, dataset="text_padded", trainer_kwargs=CLIP)


def test_two_context_ranks_match_one_process_with_each_method_checkpointed_and_sharded():
    cases = {f"cp2/{m}": _gpt(context_parallel_size=2, context_parallel_method=m) for m in ("ring", "ulysses")}
    # recomputation replays the context attention (and its communication) in backward
    cases["cp2/ring/checkpointed"] = _gpt(context_parallel_size=2, activation_checkpointing="full")
    cases["cp2/ulysses/zero3"] = _gpt(context_parallel_size=2, context_parallel_method="ulysses", zero_stage=3)
    cases["cp2/ring/zero2/units"] = _gpt(context_parallel_size=2, zero_stage=2, bucket_size_mb=0.1)  # 3 layers + 1
    per_rank = run_processes(fit_cases, 2, cases, timeout=600)
    worst = assert_parity(per_rank, reference_losses(cases))
    print("max |loss - one process|:", worst)


def test_context_composed_with_data_pipeline_and_tensor_on_four_ranks():
    cases = {
        "cp4/ring": _gpt(context_parallel_size=4),
        "cp4/ulysses": _gpt(context_parallel_size=4, context_parallel_method="ulysses"),
        "dp2xcp2/ring": _gpt(2, context_parallel_size=2),
        "dp2xcp2/zero2/ulysses": _gpt(2, context_parallel_size=2, context_parallel_method="ulysses", zero_stage=2),
        "cp2xpp2/ring": _gpt(context_parallel_size=2, pipeline_parallel_size=2),
        "cp2xtp2/ring": _gpt(context_parallel_size=2, tensor_parallel_size=2),
        "cp2xtp2/ulysses": _gpt(context_parallel_size=2, tensor_parallel_size=2, context_parallel_method="ulysses"),
    }
    per_rank = run_processes(fit_cases, 4, cases, timeout=900)
    worst = assert_parity(per_rank, reference_losses(cases))
    print("max |loss - one process|:", worst)


def _gpt_per_rank_mean():
    """The recipe with a loss that is each rank's own token mean (the mistake a context split invites)."""
    import torch.nn.functional as F

    from examples.nlp.model import IGNORE_INDEX

    model = tiny_gpt()

    def training_step(batch, batch_idx):
        inputs, targets = batch
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=IGNORE_INDEX)
        model.log("train_loss", model.trainer.strategy.reduce(loss.detach(), reduce_op="mean"))
        return loss

    model.training_step = training_step
    return model


def _gpt_local_positions():
    """The recipe whose plan forgets the position module: each rank embeds positions 0..s_local-1."""
    model = tiny_gpt()
    model.context_parallel_plan = lambda: {"blocks.*.attn.core": "attention"}
    return model


def test_negative_controls_a_per_rank_mean_or_local_positions_are_caught():
    cases = {
        "per-rank-mean": dict(_gpt(context_parallel_size=2), model_factory=_gpt_per_rank_mean),
        "local-positions": dict(_gpt(context_parallel_size=2), model_factory=_gpt_local_positions),
    }
    per_rank = run_processes(fit_cases, 2, cases, timeout=600)
    reference = reference_losses({name: _gpt() for name in cases})
    for name in cases:
        diffs = [max(abs(a - b) for a, b in zip(r[name], reference[name])) for r in per_rank]
        assert min(diffs) > 1e-4, f"{name}: the parity comparison did not see the mistake ({diffs})"
