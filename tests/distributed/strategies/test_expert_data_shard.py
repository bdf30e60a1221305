"""``expert_data_shard=True``: each rank's experts sharded again over the ranks holding the same experts (FSDP2 over
the expert-data group), with one process's losses and half the expert bytes per rank at data 4 x expert 2.

The GPT recipe's MoE block (4 experts, top-2 softmax routing, dropless, the global balancing loss), fp32, AdamW,
gradient clipping 0.5, 8 steps of right-padded byte windows. Without the option every rank of an expert-data group
keeps its ``E/ep`` experts whole (today's layout): the bytes compared are the expert parameters' local storage.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_recording_losses
from tests.distributed.parity_runs import SAMPLES, padded_text_dataset
from tests.distributed.strategies.parity import assert_parity, reference_losses
from tests.distributed.strategies.test_expert_parity import _case, moe_gpt

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp4/ep2": dict(data_parallel_size=4, expert_parallel_size=2),
    "dp4/ep2/expert-data shard": dict(data_parallel_size=4, expert_parallel_size=2, expert_data_shard=True),
    "dp4/ep2/zero3/expert-data shard": dict(data_parallel_size=4, expert_parallel_size=2, zero_stage=3,
                                            expert_data_shard=True),
}


def _expert_bytes(module) -> int:
    from lightning_parallel.parallel.experts.sharded import expert_parameters

    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in expert_parameters(module)]
    return sum(t.numel() * t.element_size() for t in local)


def _fit_and_measure(rank, world_size, cases):
    results = {}
    for name, case in cases.items():
        model = case["model_factory"]()
        losses = fit_recording_losses(model, case["strategy"](), world_size, padded_text_dataset(SAMPLES, 16),
                                      case["global_batch"] // case["data_parallel"], case["steps"],
                                      **case["trainer_kwargs"])
        results[name] = {"losses": losses, "expert_bytes": _expert_bytes(model)}
    return results


def test_experts_sharded_over_their_expert_data_ranks_hold_half_the_bytes_and_match_one_process():
    cases = {name: _case(4, **options) for name, options in LAYOUTS.items()}
    per_rank = run_processes(_fit_and_measure, 4, cases, timeout=900)
    losses = [{name: result[name]["losses"] for name in cases} for result in per_rank]
    worst = assert_parity(losses, reference_losses(cases))
    print("max |loss - one process|:", worst)
    for result in per_rank:
        whole = result["dp4/ep2"]["expert_bytes"]
        assert whole > 0
        assert result["dp4/ep2/expert-data shard"]["expert_bytes"] * 2 == whole
        assert result["dp4/ep2/zero3/expert-data shard"]["expert_bytes"] * 2 == whole


def test_expert_data_shard_needs_an_expert_axis():
    with pytest.raises(ValueError, match="expert_parallel_size=1"):
        Hybrid(expert_data_shard=True)
    assert partial(moe_gpt)  # the MoE recipe the parity cases build


BATCHES, BATCH = 4, 8  # batches per epoch, global batch
SHARDED = dict(data_parallel_size=4, expert_parallel_size=2, expert_data_shard=True)


def _epochs(world_size, strategy, epochs, callbacks=(), ckpt_path=None):
    from tests.distributed.parity_runs import fit_text_epochs

    return fit_text_epochs(moe_gpt, world_size, strategy, epochs, batches=BATCHES, global_batch=BATCH,
                           data_parallel=world_size, callbacks=callbacks, ckpt_path=ckpt_path)


def _saver(root, name):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=root, filename=name, save_top_k=-1, save_on_train_epoch_end=True)


def _save_today(rank, world_size, root):
    return _epochs(world_size, Hybrid(data_parallel_size=2, expert_parallel_size=2), 1, [_saver(root, "today")])


def _save_sharded_then_resume_today_sharded(rank, world_size, root):
    _epochs(world_size, Hybrid(**SHARDED), 1, [_saver(root, "sharded")])
    return _epochs(world_size, Hybrid(**SHARDED), 2, ckpt_path=f"{root}/today.ckpt")


def _resume_sharded_today(rank, world_size, root):
    return _epochs(world_size, Hybrid(data_parallel_size=2, expert_parallel_size=2), 2,
                   ckpt_path=f"{root}/sharded.ckpt")


def _uninterrupted(rank, world_size):
    return _epochs(world_size, "auto", 2)


@pytest.mark.extended  # the suite's time budget (65 s here); the parity test above runs by default
def test_checkpoints_reshard_between_expert_data_sharded_and_whole_experts(tmp_path):
    """Saved under data 2 x expert 2 (experts whole) and resumed under data 4 x expert 2 with the experts sharded
    over their expert-data ranks, and the other way round: the uninterrupted one-process losses both times."""
    root = str(tmp_path)
    run_processes(_save_today, 2, root, timeout=600)
    into_sharded = run_processes(_save_sharded_then_resume_today_sharded, 4, root, timeout=900)
    into_today = run_processes(_resume_sharded_today, 2, root, timeout=600)
    reference = run_processes(_uninterrupted, 1)[0]
    for direction, per_rank in (("whole -> sharded", into_sharded), ("sharded -> whole", into_today)):
        for rank, losses in enumerate(per_rank):
            diff = max_abs_difference(losses, reference[BATCHES:])
            assert len(losses) == BATCHES and diff < 1e-5, f"{direction}, rank {rank}: {diff:.2e}"


def test_expert_data_shard_with_one_rank_per_expert_is_refused_before_any_process_group():
    from lightning_parallel.parallel.checks import check_module

    strategy = Hybrid(data_parallel_size=2, expert_parallel_size=2, expert_data_shard=True)
    with pytest.raises(ValueError, match="each expert is on one rank only"):
        check_module(moe_gpt().build(), strategy.resolve_layout(2), strategy.options)
