"""Tensor parallelism on 2 and 4 gloo ranks matches one process, with the expected collectives.

One launch per world size runs every check (spawning costs seconds); see ``tp_runs.py``.
"""

import pytest

from lightning_parallel.testing import max_abs_difference, run_processes
from tests.distributed.parallel.tp_runs import COLLECTIVE_CASES, PARITY_CASES, tp_checks

pytestmark = pytest.mark.slow

STEPS = 6
N_BLOCKS = 2


# tp4 with -m extended (the suite's time budget: 18 s); tp2 by default.
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.extended)], ids=["tp2", "tp4"])
def checks(request):
    tp = request.param
    return tp, run_processes(tp_checks, tp, STEPS, tp == 2, timeout=300)


def test_gpt_losses_match_one_process_on_every_rank(checks):
    tp, per_rank = checks
    for rank, result in enumerate(per_rank):
        for case, run in zip(PARITY_CASES, result["parity"]):
            assert max_abs_difference(run["losses"], run["ref_losses"]) < 1e-5, f"tp={tp} rank {rank} {case}"
            # Every rank of the tensor group reports the same loss.
            assert run["losses"] == per_rank[0]["parity"][PARITY_CASES.index(case)]["losses"], f"rank {rank} {case}"


def test_clipping_uses_the_global_gradient_norm(checks):
    tp, per_rank = checks
    for rank, result in enumerate(per_rank):
        for case, run in zip(PARITY_CASES, result["parity"]):
            assert max_abs_difference(run["norms"], run["ref_norms"]) < 1e-5 * max(run["ref_norms"]), f"{rank} {case}"
            if case[3] < float("inf"):
                assert run["ref_norms"][0] > case[3]  # clipping actually scaled the gradients


def test_parity_check_detects_unsynchronised_replicas(checks):
    # Negative control: one rank's norm weight differs (a custom init that was not
    # broadcast). SequenceParallel trusts replicas to agree, so the losses must drift.
    tp, per_rank = checks
    if tp != 2:
        pytest.skip("the negative control runs on the 2-rank launch only")
    run = per_rank[0]["perturbed"][0]
    assert max_abs_difference(run["losses"], run["ref_losses"]) > 1e-4


# Collectives of one forward + backward of the 2-block GPT plan (counts do not depend on tp).
# Without sequence parallelism:
#   forward  all-reduce: embed.tok (vocab-sharded lookup sums partial rows) 1
#                        + per block attn.out and mlp.down (row-parallel)     2 x 2 = 4  -> 5
#            all-gather: head.proj gathers the vocab-sharded logits           1
#   backward all-reduce: per block the gradient of the attn input and of the mlp input
#                        (gather_input makes q/k/v share one input, so one each) 2 x 2 = 4
#                        + head.proj's input gradient                         1  -> 5
# Loss parallel keeps the logits sharded: no logits all-gather, and the vocab-parallel
#   cross-entropy all-reduces max, sum-exp and the target logit (3) -> forward 5 + 3 = 8.
# Sequence parallel turns each row-parallel all-reduce into a reduce-scatter and each
# block entry into an all-gather:
#   forward  all-reduce 1 (embed.tok stays replicated: the position table is added first;
#              embed's scatter_output then slices locally), reduce-scatter 2 x 2 = 4,
#            all-gather 2 x 2 (attn, mlp entries) + 1 (head.proj input) + 1 (logits) = 6
#              (5 under loss parallel, which adds its 3 all-reduces instead)
#   backward each forward all-gather of an input becomes a reduce-scatter: 4 + 1 = 5;
#            each forward reduce-scatter becomes an all-gather: 4, + 1 for embed's slice = 5;
#            all-reduce: the replicated norm weights/biases, whose gradients come from
#            sequence shards: (ln1, ln2) x 2 blocks x (weight, bias) + head.norm x 2 = 10.
# The optimizer step needs no collective (gradients already have their parameter's placement).
EXPECTED = {
    (False, False): dict(forward_all_reduce=5, forward_all_gather=1, backward_all_reduce=5),
    (False, True): dict(forward_all_reduce=8, backward_all_reduce=5),
    (True, False): dict(
        forward_all_reduce=1, forward_reduce_scatter=4, forward_all_gather=6,
        backward_all_reduce=10, backward_reduce_scatter=5, backward_all_gather=5,
    ),
    (True, True): dict(
        forward_all_reduce=4, forward_reduce_scatter=4, forward_all_gather=5,
        backward_all_reduce=10, backward_reduce_scatter=5, backward_all_gather=5,
    ),
}
KINDS = [
    f"{phase}_{kind}" for phase in ("forward", "backward") for kind in ("all_reduce", "reduce_scatter", "all_gather")
]


def _expected(**nonzero):
    return {kind: nonzero.get(kind, 0) for kind in KINDS} | {"optimizer_step_total": 0}


def test_collective_counts_of_the_gpt_plan(checks):
    tp, per_rank = checks
    measured = {
        tuple(run["case"][:2]): run["counts"]
        for case, run in zip(COLLECTIVE_CASES, per_rank[0]["collectives"])
        if not case[2]
    }
    for key, nonzero in EXPECTED.items():
        assert measured[key] == _expected(**nonzero), f"tp={tp} sequence_parallel, loss_parallel = {key}"
    for result in per_rank[1:]:
        assert result["collectives"] == per_rank[0]["collectives"]


def test_collective_counts_catch_a_changed_plan(checks):
    _, per_rank = checks
    by_overrides = {tuple(run["case"][2]): run["counts"] for run in per_rank[0]["collectives"] if run["case"][2]}
    # Without gather_input on attn, q, k and v each all-reduce their input gradient: +2 per block.
    assert by_overrides[("blocks.*.attn",)] == _expected(
        forward_all_reduce=5, forward_all_gather=1, backward_all_reduce=5 + 2 * N_BLOCKS
    )
    # MLPs silently left replicated: one all-reduce per block fewer in each direction.
    assert by_overrides[("blocks.*.mlp", "blocks.*.mlp.down", "blocks.*.mlp.up")] == _expected(
        forward_all_reduce=5 - N_BLOCKS, forward_all_gather=1, backward_all_reduce=5 - N_BLOCKS
    )


def test_sharded_parameters_take_one_tp_th_of_the_bytes(checks):
    tp, per_rank = checks
    for rank, result in enumerate(per_rank):
        full, sharded, replicated = result["bytes"]["full"], result["bytes"]["sharded"], result["bytes"]["replicated"]
        for name, nbytes in sharded.items():
            assert nbytes * tp == full[name], f"rank {rank} {name}"
        assert sum(sharded.values()) * tp == sum(full[name] for name in sharded)
        # What stays whole: norms, the position table, and row-parallel biases (added after the reduction).
        assert sorted(replicated) == sorted(
            name for name in full
            if ".ln" in name or name.startswith(("head.norm", "embed.pos")) or name.endswith(("out.bias", "down.bias"))
        )
        assert "embed.tok.weight" in sharded and "head.proj.weight" in sharded
