"""The rank record names the ranks behind the one that timed out, and where they were last seen."""

import pytest
import torch.distributed as dist

from lightning_parallel.runtime.rank_record import RankRecord, describe


def _records(world_size):
    store = dist.HashStore()
    return [RankRecord(store, rank, world_size) for rank in range(world_size)]


def test_a_rank_behind_is_named_with_the_phase_it_never_reached_and_where_it_was_seen():
    ranks = _records(4)
    for record in ranks:
        record.enter("training_step", 7)
    for record in ranks[:3]:
        record.enter("backward", 7)
        record.enter("optimizer_step", 7)
    for record in ranks[1:3]:
        record.own["timed_out"] = True
        record.store.set(f"lightning_parallel/rank_record/{record.rank}", __import__("json").dumps(record.own))
    message = ranks[0].where_others_were(settle_s=0.0)
    assert "rank 3 never reached optimizer_step of step 7 (last seen: training_step of step 7, " in message
    assert "ranks 0, 1, 2 timed out waiting there" in message


def test_a_rank_stuck_inside_the_same_phase_is_told_from_the_ranks_waiting_in_it():
    ranks = _records(2)
    for record in ranks:
        record.enter("optimizer_step", 3)
    message = ranks[0].where_others_were(settle_s=0.0)
    assert "rank 1 is in optimizer_step of step 3 too but did not time out: stuck inside it" in message


def test_a_rank_that_never_wrote_is_named_and_validation_counts_as_the_start_of_the_next_step():
    records = {0: {"phase": "validation", "step": 5, "t": 0.0, "timed_out": True},
               1: {"phase": "optimizer_step", "step": 4, "t": 0.0, "timed_out": False}, 2: None}
    message = describe(records, 0, now=2.5)
    assert "rank 1 never reached validation of step 5 (last seen: optimizer_step of step 4, 2.5 s ago)" in message
    assert "rank 2 never recorded a phase" in message


def test_no_rank_behind_says_so_rather_than_blaming_one():
    records = {r: {"phase": "backward", "step": 1, "t": 0.0, "timed_out": True} for r in range(2)}
    assert "none is behind" in describe(records, 0, now=1.0)


def test_a_store_that_is_gone_is_reported_not_raised():
    class Gone:
        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    record = RankRecord(Gone(), 1, 2)
    record.own = {"phase": "backward", "step": 2, "t": 0.0, "timed_out": False}
    assert "the run's store did not answer (Connection reset by peer)" in record.where_others_were(settle_s=0.0)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="Unknown phase 'forward'"):
        _records(2)[0].enter("forward", 0)


def test_a_rank_whose_process_is_gone_is_said_to_have_died_where_it_was():
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    base = {"t": 0.0, "timed_out": False, "host": socket.gethostname()}
    records = {0: {**base, "phase": "training_step", "step": 5, "timed_out": True},
               1: {**base, "phase": "training_step", "step": 5, "pid": pid}}
    assert f"rank 1 died (process {pid} is gone) in training_step of step 5" in describe(records, 0, now=1.0)
    records[1] = {**base, "phase": "backward", "step": 4, "pid": pid}
    assert f"rank 1 died (process {pid} is gone) before reaching training_step of step 5" in describe(records, 0, 1.0)
