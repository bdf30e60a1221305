"""DiLoCo's outer loop on one rank (``fault_tolerance/diloco.py``), two replica groups played by two threads of one
process through a manager that sums their tensors: the meeting is DiLoCo's outer Nesterov step on the averaged
pseudo-gradient, fragments meet at their staggered steps, a healed group joins uncounted, a failed meeting changes
nothing, bf16 halves the bytes, and the state a recovering group receives makes it identical."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.fault_tolerance.diloco import OuterSync, split_fragments, trainable
from lightning_parallel.fault_tolerance.options import FaultTolerance


class _Done:
    def wait(self) -> None:
        """Already summed."""


class _Hub:
    """The cross-group all-reduce of two groups: each call blocks until both groups made it, then both hold the sum."""

    def __init__(self, commit: bool = True) -> None:
        self.barrier, self.slots, self.commit = threading.Barrier(2), {}, commit

    def manager(self, group: int) -> Any:
        hub, calls = self, [0]

        class Manager:
            def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> _Done:
                key = calls[0]
                calls[0] += 1
                hub.slots[(key, group)] = tensor.clone()
                hub.barrier.wait()
                tensor.copy_(hub.slots[(key, 0)] + hub.slots[(key, 1)])
                hub.barrier.wait()
                return _Done()

            def should_commit(self) -> bool:
                return hub.commit

        return Manager()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


def _groups(options: FaultTolerance) -> tuple[list[nn.Module], list[OuterSync]]:
    models = [_model(), _model()]
    syncs = [OuterSync(trainable(m), options) for m in models]
    for g, model in enumerate(models):  # each group drifts its own way
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(g + 1)) * 0.1)
    return models, syncs


def _meet_both(syncs: list[OuterSync], hub: _Hub, step: int, contributes=(True, True)) -> list[bool]:
    results = [None, None]

    def run(g: int) -> None:
        manager = hub.manager(g)
        syncs[g].start(manager, step - syncs[g].delay, contributes[g])
        results[g] = syncs[g].finish(manager)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_fragments_are_contiguous_runs_of_about_equal_size() -> None:
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([5], 3) == [[], [0], []]  # an empty fragment on this rank still meets (zero bytes)


@pytest.mark.parametrize(("options", "meetings"), [
    ({"mode": "diloco", "sync_every": 5}, {5: 0, 10: 0, 15: 0}),
    ({"mode": "streaming_diloco", "sync_every": 6, "fragments": 3}, {2: 0, 4: 1, 6: 2, 8: 0, 10: 1, 12: 2, 14: 0}),
])
def test_fragments_meet_at_their_staggered_steps(options: dict, meetings: dict) -> None:
    sync = OuterSync(trainable(_model()), FaultTolerance(**options))
    assert {s: sync.fragment_at(s) for s in range(16) if sync.fragment_at(s) is not None} == {
        s: f for s, f in meetings.items() if s < 16}


def test_a_meeting_is_an_outer_nesterov_step_on_the_averaged_pseudo_gradient() -> None:
    options = FaultTolerance(mode="diloco", sync_every=5, outer_lr=0.7, outer_momentum=0.9)
    models, syncs = _groups(options)
    start = [p.detach().clone() for p in _model().parameters()]
    drifted = [[p.detach().clone() for p in m.parameters()] for m in models]
    assert _meet_both(syncs, _Hub(), 5) == [True, True]
    for i, p0 in enumerate(start):
        pseudo = ((p0 - drifted[0][i]) + (p0 - drifted[1][i])) / 2
        expected = p0 - 0.7 * (pseudo + 0.9 * pseudo)  # Nesterov's first step: buffer = g, update g + m * buffer
        for model in models:
            assert torch.allclose(list(model.parameters())[i], expected, atol=1e-6)
        assert torch.allclose(syncs[0].originals[i], expected, atol=1e-6)
    state0, state1 = syncs[0].state_dict(), syncs[1].state_dict()
    for a, b in zip(state0["outer"]["state"].values(), state1["outer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_only_the_meeting_fragment_moves() -> None:
    options = FaultTolerance(mode="streaming_diloco", sync_every=4, fragments=2)
    models, syncs = _groups(options)
    before = [p.detach().clone() for p in models[0].parameters()]
    _meet_both(syncs, _Hub(), 4)  # fragment 1: the second half of the parameters
    moved = [not torch.equal(p, b) for p, b in zip(models[0].parameters(), before)]
    fragment = set(syncs[0].fragments[1])
    assert moved == [i in fragment for i in range(len(before))] and any(moved) and not all(moved)
    assert [m["fragment"] for m in syncs[0].meetings] == [1]


def test_a_group_healed_at_the_meeting_joins_its_average_uncounted() -> None:
    options = FaultTolerance(mode="diloco", sync_every=5)
    models, syncs = _groups(options)
    syncs[1].load_state_dict(syncs[0].state_dict())  # what a healing group receives ...
    models[1].load_state_dict(models[0].state_dict())  # ... with the donor's parameters
    _meet_both(syncs, _Hub(), 5, contributes=(True, False))
    alone_models, alone = _groups(options)
    _meet_both(alone, _Hub(), 5, contributes=(True, True))  # control: both contribute, different average
    for a, b, c in zip(models[0].parameters(), models[1].parameters(), alone_models[0].parameters()):
        assert torch.equal(a, b)
        assert not torch.equal(a, c)
    start = [p.detach().clone() for p in _model().parameters()]
    expected = [p0 - 0.7 * 1.9 * (p0 - d) for p0, d in zip(start, [p.detach() for p in _groups(options)[0][0]
                                                                     .parameters()])]
    for p, e in zip(models[0].parameters(), expected):
        assert torch.allclose(p, e, atol=1e-6)  # the donor's pseudo-gradient alone, not counted twice


def test_a_meeting_that_does_not_commit_changes_nothing() -> None:
    models, syncs = _groups(FaultTolerance(mode="diloco", sync_every=5))
    before = [p.detach().clone() for p in models[0].parameters()]
    originals = [t.clone() for t in syncs[0].originals]
    assert _meet_both(syncs, _Hub(commit=False), 5) == [False, False]
    assert all(torch.equal(p, b) for p, b in zip(models[0].parameters(), before))
    assert all(torch.equal(t, o) for t, o in zip(syncs[0].originals, originals))
    assert syncs[0].outer.state_dict()["state"] == {}


def test_bf16_exchange_sends_half_the_bytes_and_lands_near_fp32() -> None:
    results = {}
    for exchange in ("fp32", "bf16"):
        models, syncs = _groups(FaultTolerance(mode="diloco", sync_every=5, exchange=exchange))
        _meet_both(syncs, _Hub(), 5)
        results[exchange] = ([p.detach().clone() for p in models[0].parameters()], syncs[0].meetings[0]["bytes"])
    (fp32, fp32_bytes), (bf16, bf16_bytes) = results["fp32"], results["bf16"]
    params = sum(p.numel() for p in fp32)
    assert (fp32_bytes, bf16_bytes) == (4 * params + 4, 2 * params + 4)  # the count travels in fp32
    gap = max(float((a - b).abs().max()) for a, b in zip(fp32, bf16))
    assert 0 < gap < 1e-2


def test_an_overlapped_exchange_lands_mixed_with_the_steps_trained_meanwhile() -> None:
    options = FaultTolerance(mode="diloco", sync_every=5, sync_delay=2, fragment_mix=0.5)
    models, syncs = _groups(options)
    assert [s for s in range(1, 11) if syncs[0].starts_at(s)] == [3, 8]
    start = [p.detach().clone() for p in _model().parameters()]
    drifted = [[p.detach().clone() for p in m.parameters()] for m in models]
    hub, managers = _Hub(), [None, None]

    def begin(g: int) -> None:
        managers[g] = hub.manager(g)
        syncs[g].start(managers[g], 3, True)

    threads = [threading.Thread(target=begin, args=(g,)) for g in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert syncs[0].pending
    with torch.no_grad():  # two more inner steps while the exchange is in flight
        for p in models[0].parameters():
            p.add_(0.01)
    assert syncs[0].finish(managers[0]) and not syncs[0].pending
    for p, p0, d0, d1 in zip(models[0].parameters(), start, *drifted):
        outer = p0 - 0.7 * 1.9 * ((p0 - d0) + (p0 - d1)) / 2
        assert torch.allclose(p, 0.5 * outer + 0.5 * (d0 + 0.01), atol=1e-6)
    assert syncs[0].meetings == [{"step": 5, "started": 3, "fragment": 0, "committed": True,
                                  "bytes": syncs[0].meetings[0]["bytes"]}]


def test_the_recovery_state_makes_a_restarted_group_identical() -> None:
    options = FaultTolerance(mode="diloco", sync_every=5)
    models, syncs = _groups(options)
    _meet_both(syncs, _Hub(), 5)
    restarted = OuterSync(trainable(_model(seed=7)), options)
    restarted.load_state_dict(syncs[0].state_dict())
    for a, b in zip(restarted.originals, syncs[0].originals):
        assert torch.equal(a, b)
    mine, theirs = restarted.outer.state_dict()["state"], syncs[0].outer.state_dict()["state"]
    assert mine.keys() == theirs.keys() and mine
    assert all(torch.equal(mine[k]["momentum_buffer"], theirs[k]["momentum_buffer"]) for k in mine)
    with pytest.raises(ValueError, match="same model and layout"):
        OuterSync(trainable(nn.Linear(2, 2)), options).load_state_dict(syncs[0].state_dict())


@pytest.mark.parametrize(("config", "message"), [
    ({"mode": "streaming_diloco", "sync_every": 5, "fragments": 2}, "divide sync_every"),
    ({"mode": "streaming_diloco", "fragments": 1}, "at least 2"),
    ({"mode": "diloco", "outer_momentum": 0.0}, "outer_nesterov=false"),
    ({"mode": "diloco", "exchange": "int8"}, "int8 is not built"),
    ({"mode": "diloco", "outer_lr": 0}, "outer_lr"),
    ({"mode": "streaming_diloco", "sync_every": 6, "fragments": 3, "sync_delay": 2}, r"sync_delay=2 .* \[0, 2\)"),
    ({"mode": "diloco", "fragment_mix": 1.5}, "fragment_mix"),
])
def test_bad_diloco_options_are_refused_with_the_fix(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultTolerance(**config)
