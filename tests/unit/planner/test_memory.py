"""Bytes per rank: the planner's formulas against a real model instantiation and the suite's own partition."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.parallel.pipeline.partition import partition_layers
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.memory import stage_layers, state_bytes, working_bytes
from lightning_parallel.planner.profile import profile_module
from lightning_parallel.planner.shapes import llama3_shape

KWARGS = {"seq_len": 16, "d_model": 32, "n_layer": 3, "n_head": 4, "vocab_size": 64}


@pytest.fixture(scope="module")
def gpt_and_shape():
    torch.manual_seed(0)
    model = GPT(**KWARGS).build()
    return model, profile_module(model, torch.randint(0, 64, (2, 16)), "gpt")


def layout(dp=1, pp=1, tp=1, zero=0, engine="hybrid", schedule="1f1b", v=1) -> Candidate:
    return Candidate(engine, dp, pp, tp, zero, schedule if pp > 1 else "-", v, pp * v if pp > 1 else 1, 8, 1, 8 * dp)


def states(shape, c: Candidate) -> list[float]:
    return [sum(state_bytes(shape, c, [i for s in rank for i in s])) for rank in stage_layers(shape, c)]


def test_replicated_states_equal_the_instantiated_model(gpt_and_shape) -> None:
    model, shape = gpt_and_shape
    numel = sum(p.numel() for p in model.parameters())
    assert shape.num_params == numel
    tensors = len(list(model.parameters()))
    # fp32 parameters + gradients + AdamW's two moments, and AdamW's 4-byte step counter per tensor
    assert states(shape, layout(dp=2)) == [4 * numel * 4 + 4 * tensors]


def test_pipeline_ranks_hold_the_partition_the_strategy_cuts(gpt_and_shape) -> None:
    model, shape = gpt_and_shape
    layers = model.pipeline_layers()
    for schedule, v in (("1f1b", 1), ("interleaved_1f1b", 2)):
        bounds = partition_layers(layers, 2 * v, "parameters")
        c = layout(pp=2, schedule=schedule, v=v)
        per_rank = stage_layers(shape, c)
        for rank, stages in enumerate(per_rank):
            held = [i for s in stages for i in s]
            expected = {i for s in range(2 * v) if s % 2 == rank for i in range(bounds[s], bounds[s + 1])}
            assert set(held) == expected
            numel = sum(p.numel() for i in held for p in layers[i].parameters())
            tensors = sum(1 for i in held for _ in layers[i].parameters())
            assert sum(state_bytes(shape, c, held)) == 16 * numel + 4 * tensors


def test_tensor_parallel_divides_the_planned_matrices(gpt_and_shape) -> None:
    model, shape = gpt_and_shape
    d, v, s, hidden = 32, 64, 16, 128
    # Sharded by the GPT plan: q/k/v/up (weight + bias), out/down/head/token-embedding weights.
    sharded = 3 * (d * d + d) + (hidden * d + hidden) + d * d + d * hidden
    per_block_replicated = 4 * d + d + d  # two LayerNorms (weight + bias), out and down biases
    total_sharded = 3 * sharded + v * d + v * d  # blocks, token embedding, head projection
    replicated = 3 * per_block_replicated + s * d + 2 * d  # position table, final norm
    assert total_sharded + replicated == shape.num_params
    steps = 4 * sum(len(layer.params) for layer in shape.layers)  # AdamW's step counters
    assert states(shape, layout(tp=2)) == [16 * (total_sharded // 2 + replicated) + steps]


def test_fsdp_shards_dim0_after_tensor_parallelism(gpt_and_shape) -> None:
    _, shape = gpt_and_shape
    expected = sum(-(-p.shape[0] // 2) * (p.numel // p.shape[0]) for layer in shape.layers for p in layer.params)
    steps = 4 * sum(len(layer.params) for layer in shape.layers)  # AdamW's step counters
    for zero in (2, 3):
        assert states(shape, layout(dp=2, zero=zero)) == [16 * expected + steps]
    # ZeRO-2 keeps the whole model gathered between forward and backward; ZeRO-3 one layer (and the next).
    full = 4 * shape.num_params
    assert working_bytes(shape, layout(dp=2, zero=2), list(range(len(shape.layers)))) == full
    assert working_bytes(shape, layout(dp=2, zero=3), list(range(len(shape.layers)))) < full


def test_deepspeed_stages_shard_state_then_gradients_then_parameters(gpt_and_shape) -> None:
    _, shape = gpt_and_shape
    n, all_layers = shape.num_params, list(range(len(shape.layers)))
    share = -(-n // 4)
    got = [state_bytes(shape, layout(dp=4, zero=z, engine="deepspeed"), all_layers) for z in (1, 2, 3)]
    assert got == [(4 * n, 4 * n, 8 * share), (4 * n, 4 * share, 8 * share), (4 * share, 4 * share, 8 * share)]


def test_llama3_shapes_have_the_published_parameter_counts() -> None:
    assert llama3_shape("llama3-8b").num_params == pytest.approx(8.03e9, rel=0.005)
    assert llama3_shape("llama3-70b").num_params == pytest.approx(70.55e9, rel=0.005)
    with pytest.raises(ValueError, match="Unknown shape"):
        llama3_shape("llama3-13b")


def test_checkpointing_lowers_activations(gpt_and_shape) -> None:
    from lightning_parallel.planner.memory import activation_bytes

    _, shape = gpt_and_shape
    block = 1
    c = layout()
    assert activation_bytes(shape, replace(c, checkpointing="full"), block, 8) < activation_bytes(shape, c, block, 8)
    assert activation_bytes(shape, replace(c, tp=2), block, 8) < activation_bytes(shape, c, block, 8)


def test_muon_holds_one_state_per_matrix_element_and_adamw_two_for_the_rest():
    from functools import partial

    from omegaconf import OmegaConf

    from examples.nlp.model import GPT
    from lightning_parallel.optim import MuonWithAdamW
    from lightning_parallel.planner.from_config import optimizer_states

    cfg = OmegaConf.create({"model": {"optimizer": {"_target_": "lightning_parallel.optim.MuonWithAdamW"}}})
    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4,
                optimizer=partial(MuonWithAdamW)).build()
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2)
    total = sum(p.numel() for p in model.parameters())
    assert optimizer_states(cfg, model) == (blocks + 2 * (total - blocks)) / total
    assert optimizer_states(OmegaConf.create({"model": {"optimizer": {"_target_": "torch.optim.AdamW"}}})) == 2
