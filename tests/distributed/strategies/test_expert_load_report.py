"""The first step's expert-load table counts the step's own token copies: the global batch's tokens x top-k per MoE
layer, under a pipeline schedule too. torch runs each stage once more to infer its shapes (one micro-batch), which
the table used to add: 1,536 copies for a batch of 1,024 under pipeline x expert."""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import fit_losses, tiny_gpt

pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN, TOP_K = 8, 16, 2


def _copies_on_the_first_step(rank, world_size, options):
    from lightning_parallel.strategies.hybrid import expert_load_report as expert_load

    seen = []
    original = expert_load._global_load

    def recording(layer, group):
        load = original(layer, group)
        seen.append(float(load.sum()))
        return load

    expert_load._global_load = recording  # the table's figures, as computed for it
    model = partial(tiny_gpt, moe={"every": 2, "num_experts": 4, "top_k": TOP_K, "aux_loss_weight": 0.05})
    fit_losses(rank, world_size, strategy=Hybrid(**options), global_batch=GLOBAL_BATCH, data_parallel=2, steps=2,
               model_factory=model, dataset="text")
    return seen


@pytest.mark.parametrize("options", [
    {"data_parallel_size": 2, "pipeline_parallel_size": 2, "expert_parallel_size": 2, "microbatches": 2,
     "schedule": "gpipe"},
    {"data_parallel_size": 2, "expert_parallel_size": 2},
], ids=["data 2 x pipeline 2 x expert 2", "data 2 x expert 2"])
def test_the_first_step_load_adds_up_to_the_global_batchs_token_copies(options):
    world = 2 * options.get("pipeline_parallel_size", 1)
    per_rank = run_processes(_copies_on_the_first_step, world, options, timeout=600)
    counted = [copies for rank in per_rank for copies in rank]
    print("copies per MoE layer as reported, every rank holding one:", counted)
    assert counted and set(counted) == {GLOBAL_BATCH * SEQ_LEN * TOP_K}
