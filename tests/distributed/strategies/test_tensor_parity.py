"""TensorParallelStrategy matches one process (residual MLP and GPT; sequence/loss parallel; clipping)."""

from functools import partial

import pytest

from lightning_parallel.strategies import TensorParallelStrategy
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import fit_cases, tiny_gpt
from tests.distributed.strategies.parity import assert_parity, reference_losses

pytestmark = pytest.mark.slow


def _cases(tp, mlp_optimizers=("sgd", "adamw"), with_gpt=True):
    tps = partial(TensorParallelStrategy, tensor_parallel_size=tp)
    cases = {}
    for opt in mlp_optimizers:
        cases[f"mlp/{opt}"] = dict(strategy=tps, global_batch=16, data_parallel=1, optimizer=opt)
        cases[f"mlp/{opt}/clip"] = dict(strategy=tps, global_batch=16, data_parallel=1, optimizer=opt,
                                        trainer_kwargs={"gradient_clip_val": 0.5})
    if not with_gpt:
        return cases
    for sp in (False, True):
        for lp in (False, True):
            gpt = dict(global_batch=8, data_parallel=1, model_factory=tiny_gpt, dataset="text")
            cases[f"gpt/sp={sp}/lp={lp}"] = dict(strategy=partial(tps, sequence_parallel=sp, loss_parallel=lp), **gpt)
    sgd = partial(__import__("torch").optim.SGD, lr=0.1, momentum=0.9)
    cases["gpt/sgd/clip"] = dict(strategy=partial(tps, sequence_parallel=True, loss_parallel=True), global_batch=8,
                                 data_parallel=1, model_factory=partial(tiny_gpt, optimizer=sgd),
                                 dataset="text", trainer_kwargs={"gradient_clip_val": 0.5})
    return cases


# The default cell: tp=2, the MLP with AdamW (plain and clipped) and every GPT case. The MLP with plain SGD and
# tp=4 repeat the claim with `pytest -m extended`; the default run proves four-way tensor sharding in
# tests/distributed/parallel/test_tensor_parallel.py (tp4) and tests/integration/test_recipes.py.
@pytest.mark.parametrize(("tp", "mlp_optimizers", "with_gpt"), [
    (2, ("adamw",), True),
    pytest.param(2, ("sgd",), False, marks=pytest.mark.extended),
    pytest.param(4, ("sgd", "adamw"), True, marks=pytest.mark.extended),
], ids=["tp2", "tp2-mlp-sgd", "tp4"])
def test_tensor_parallel_matches_one_process_on_every_rank(tp, mlp_optimizers, with_gpt):
    cases = _cases(tp, mlp_optimizers, with_gpt)
    per_rank = run_processes(fit_cases, tp, cases, timeout=900)
    assert_parity(per_rank, reference_losses(cases))
    for name in cases:  # the tensor group reports one loss
        assert all(r[name] == per_rank[0][name] for r in per_rank), name
