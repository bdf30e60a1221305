"""simulate() on small worlds: classes, why ranks share one, the whole-world check and its negative control."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner import simulate
from lightning_parallel.planner.simulation import WholeWorldError, check_whole_world
from lightning_parallel.planner.simulation.classes import rank_classes
from lightning_parallel.planner.simulation.rank_run import simulate_rank

# Width 34 over 4 FSDP2 shards: 9, 9, 9, 7 rows of each norm and bias.
tiny = partial(GPT, d_model=34, n_head=2, n_layer=2, seq_len=16, optimizer=partial(torch.optim.AdamW, lr=1e-3),
               warmup_steps=0)


def options(**sizes) -> ParallelOptions:
    return ParallelOptions(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **sizes})


def test_the_last_uneven_fsdp_shard_is_a_class_of_its_own_with_the_same_padded_storage():
    simulation = simulate(tiny, options(data_parallel_size=4, zero_stage=3), 4, device_memory=80e9)
    full, last = simulation.classes

    assert (full.ranks, last.ranks) == ((0, 1, 2), (3,))
    assert full.parameter_bytes == last.parameter_bytes  # FSDP2 pads every shard to the same rows
    assert last.optimizer_bytes < full.optimizer_bytes  # AdamW's state follows the shorter local shard
    assert "data_parallel 3" in last.why and "pipeline position 0" in full.why
    assert simulation.fits and simulation.to_json()["classes"][0]["rank_count"] == 3


def test_json_has_the_keys_the_issue_asks_for():
    found = simulate(tiny, options(data_parallel_size=2, pipeline_parallel_size=2, microbatches=2), 4).to_json()
    assert {"world_size", "classes", "fits", "seconds"} <= set(found)
    assert {"ranks", "parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes",
            "collectives"} <= set(found["classes"][0])
    assert [c["stages"] for c in found["classes"]] == [[0], [1]]


def test_the_ddp_path_is_simulated_without_its_wrapper_and_says_so():
    simulation = simulate(tiny, options(data_parallel_size=4), 4)
    (only,) = simulation.classes
    assert only.gradient_bytes == only.parameter_bytes and "DDP" in only.notes[0]


def test_a_layout_a_real_run_refuses_is_refused_with_the_same_message():
    """Tensor size 4 for 2 heads: the strategy's check_module refuses it; the simulation runs that check itself."""
    from lightning_parallel.adapters import adapt
    from lightning_parallel.parallel.compose import check_module

    opts = options(data_parallel_size=1, tensor_parallel_size=4)
    with torch.device("meta"):
        model = tiny()
        model.configure_model()
    with pytest.raises(ValueError) as real:
        check_module(model, opts.layout(4), opts, adapter=adapt(model))
    with pytest.raises(ValueError) as simulated:
        simulate(tiny, opts, 4)
    assert str(simulated.value) == str(real.value)


def _classes(opts: ParallelOptions, world: int):
    layout = opts.layout(world)
    return rank_classes(layout, opts.zero_stage, lambda rank: simulate_rank(rank, layout, opts, tiny)), layout


def _names():
    with torch.device("meta"):
        model = tiny()
        model.configure_model()
    return {name for name, _ in model.named_parameters()}


def test_the_whole_world_check_catches_a_doubled_and_a_lost_shard():
    opts = options(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3)
    classes, layout = _classes(opts, 4)
    assert check_whole_world(classes, layout, 3, _names()) > 0

    # Rank 1's shards doubled: rank 0 claimed to hold them too (as if it sat at rank 1's tensor coordinate).
    first = classes[0]
    doubled = [replace(first, ranks=(1, 1))] + [replace(c, ranks=tuple(r for r in c.ranks if r not in (0, 1)))
                                                for c in classes]
    with pytest.raises(WholeWorldError, match="in two classes"):
        check_whole_world(doubled, layout, 3, _names())

    # Every tensor rank of one parameter placed at tensor coordinate 0 (its split read off an axis where they all sit
    # at 0): piece 0 is held twice as often as the layout says, piece 1 by nobody.
    split = next(s for s in first.record.specs if any(x.axis == "tensor_parallel" and x.dim is not None
                                                      for x in s.splits))
    moved = tuple(replace(x, axis="pipeline_parallel") if x.axis == "tensor_parallel" else x for x in split.splits)
    wrong = [replace(c, record=replace(c.record, specs=tuple(replace(s, splits=moved) if s.name == split.name else s
                                                             for s in c.record.specs))) for c in classes]
    expected = f"{split.name}.*held 2 times, the layout says 1.*doubled and a shard is lost"
    with pytest.raises(WholeWorldError, match=expected):
        check_whole_world(wrong, layout, 3, _names())

    lost = [replace(c, ranks=c.ranks) for c in classes[:-1]]
    with pytest.raises(WholeWorldError, match="in none"):
        check_whole_world(lost, layout, 3, _names())
