"""The simulated step on ``meta``: its collectives by kind and axis, the activations autograd saves (linear in the
batch, smaller under activation checkpointing), DDP's buckets, and a note where a step cannot run on ``meta``."""

from functools import partial

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner import simulate
from lightning_parallel.planner.simulation.collectives import ddp_buckets, summarize
from lightning_parallel.planner.simulation.step import fused_attention, token_batch

tiny = partial(GPT, d_model=32, n_head=2, n_layer=2, seq_len=64, optimizer=partial(torch.optim.AdamW, lr=1e-3),
               warmup_steps=0)


def options(**sizes) -> ParallelOptions:
    return ParallelOptions(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **sizes})


def step_of(batch: int, seq: int = 64, **sizes):
    return simulate(tiny, options(**sizes), 4, batch=partial(token_batch, batch, seq)).classes[0]


def test_zero3_gathers_each_unit_twice_and_reduce_scatters_it_once_over_the_data_axis():
    found = {(c["kind"], c["axis"]): c for c in step_of(2, data_parallel_size=4, zero_stage=3).collectives}

    gathers, scatters = found[("all_gather", "data_parallel")], found[("reduce_scatter", "data_parallel")]
    assert gathers["count"] == 2 * scatters["count"]  # forward and backward under ZeRO 3; one reduce-scatter
    assert gathers["bytes"] == 2 * scatters["bytes"]  # each unit's whole (padded) parameters, in fp32 both ways


def test_tensor_parallel_all_reduces_are_on_the_tensor_axis_and_grow_with_the_batch():
    small = {(c["kind"], c["axis"]): c for c in step_of(2, data_parallel_size=2, tensor_parallel_size=2,
                                                         zero_stage=3).collectives}
    large = {(c["kind"], c["axis"]): c for c in step_of(4, data_parallel_size=2, tensor_parallel_size=2,
                                                         zero_stage=3).collectives}

    key = ("all_reduce", "tensor_parallel")
    assert small[key]["count"] == large[key]["count"] > 0
    assert large[key]["bytes"] == 2 * small[key]["bytes"]  # activations: linear in the batch
    assert large[("all_gather", "data_parallel")] == small[("all_gather", "data_parallel")]  # parameters: not


def test_activations_are_linear_in_the_batch_and_checkpointing_keeps_fewer():
    one, two = step_of(2, data_parallel_size=4, zero_stage=2), step_of(4, data_parallel_size=4, zero_stage=2)
    full = step_of(4, data_parallel_size=4, zero_stage=2, activation_checkpointing="full")

    assert abs(two.activation_bytes - 2 * one.activation_bytes) <= 0.01 * two.activation_bytes
    assert full.activation_bytes < two.activation_bytes / 2
    assert two.peak_bytes == (two.parameter_bytes + two.gradient_bytes + two.optimizer_bytes + two.gathered_bytes
                              + two.activation_bytes)


def test_ddp_buckets_fill_in_reverse_order_up_to_the_capacity_per_dtype():
    params = [torch.empty(100), torch.empty(300), torch.empty(50, dtype=torch.float64)]

    # reversed: the float64 tensor opens its own bucket; 300 floats close one (1200 >= 1000); 100 floats stay open
    assert ddp_buckets(params, 1_000) == [1200, 400, 400]
    assert ddp_buckets(params, 0) == [400, 1200, 400]  # one bucket per parameter
    assert summarize([("all_reduce", "data_parallel", 5), ("all_reduce", "data_parallel", 7)]) == [
        {"kind": "all_reduce", "axis": "data_parallel", "count": 2, "bytes": 12}]


def test_the_ddp_path_reduces_its_buckets_over_the_data_axis():
    found = step_of(2, data_parallel_size=4).collectives

    assert [(c["kind"], c["axis"]) for c in found] == [("all_reduce", "data_parallel")]
    assert found[0]["bytes"] == step_of(2, data_parallel_size=4).parameter_bytes


def test_an_moe_step_sends_every_token_copy_over_the_expert_axis_with_balanced_counts():
    """One MoE block (4 experts, top 2) on 2 x 64 tokens per rank, experts over 2 ranks: the counts exchange, the rows
    out and back, and the same two exchanges of their gradients in backward -- each of the rank's 256 copies x 32
    floats -- and the expert-data group's reduction of the experts' gradients."""
    moe = partial(tiny, moe={"every": 2, "num_experts": 4, "top_k": 2, "aux_loss_weight": 0.01})
    found = simulate(moe, options(data_parallel_size=4, expert_parallel_size=2), 4,
                     batch=partial(token_batch, 2, 64)).classes[0]
    by_kind = {(c["kind"], c["axis"]): c for c in found.collectives}

    rows = 2 * 64 * 2 * 32 * 4  # tokens x top-k copies x width, fp32
    assert by_kind[("all_to_all", "expert_parallel")] == {
        "kind": "all_to_all", "axis": "expert_parallel", "count": 5, "bytes": 4 * rows + 4 * 8}  # + 4 int64 counts
    assert by_kind[("all_reduce", "expert_data")]["count"] == 1
    assert found.activation_bytes > 0 and found.details["balanced_routing_copies"] == 2 * 64 * 2
    assert any("MoE routing balanced" in note for note in found.notes)


def test_an_moe_step_with_capacity_dropping_is_left_out_with_a_note():
    moe = partial(tiny, moe={"every": 2, "num_experts": 4, "top_k": 2, "capacity_factor": 1.25})
    found = simulate(moe, options(data_parallel_size=4, expert_parallel_size=2), 4,
                     batch=partial(token_batch, 2, 64)).classes[0]

    assert found.activation_bytes is None and found.collectives == ()
    assert any("step not simulated" in note and "capacity" in note for note in found.notes)


def test_pipelined_activations_follow_the_micro_batches_the_schedule_keeps_in_flight():
    def first_stage(schedule: str):
        sizes = {"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4, "schedule": schedule}
        return simulate(tiny, options(**sizes), 4, batch=partial(token_batch, 8, 64)).classes[0]

    one_f_one_b, gpipe = first_stage("1f1b"), first_stage("gpipe")

    assert one_f_one_b.stages == (0,)
    assert one_f_one_b.activation_bytes * 2 == gpipe.activation_bytes  # 2 (pp) of 4 micro-batches in flight, or 4
    boundary = 2 * 64 * 32 * 4  # one micro-batch's hidden states: 2 sequences x 64 tokens x width 32, fp32
    assert list(one_f_one_b.collectives) == [
        {"kind": "send", "axis": "pipeline_parallel", "count": 4, "bytes": 4 * boundary},  # activations forward
        {"kind": "recv", "axis": "pipeline_parallel", "count": 4, "bytes": 4 * boundary}]  # their gradients back


def _attention_saves(device: str, kv_heads: int, value_dim: int = 8, **kwargs) -> tuple[int, tuple[int, ...]]:
    """Bytes autograd saves for one attention call (4 query heads of 8, 16 tokens) under ``fused_attention``."""
    q = torch.randn(2, 4, 16, 8, device=device, requires_grad=True)
    k = torch.randn(2, kv_heads, 16, 8, device=device, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, value_dim, device=device, requires_grad=True)
    saved = {}

    def pack(tensor):
        saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with fused_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    return sum(saved.values()), tuple(out.shape)


def test_grouped_query_attention_on_meta_saves_what_a_real_fused_kernel_saves():
    """transformers passes ``enable_gqa`` without a mask: the CPU's flash kernel keeps the 2 key/value heads
    unrepeated (q, k, v, output, log-sum-exp), and so must the meta step (torch's meta path is the math one, which
    saves the 16 x 16 weights)."""
    real, _ = _attention_saves("cpu", 2, enable_gqa=True)

    assert _attention_saves("meta", 2, enable_gqa=True)[0] == real == 4096 + 2048 + 2048 + 4096 + 512


def test_values_narrower_than_queries_save_the_fused_kernels_tensors_at_their_own_size():
    """DeepSeek's MLA: values of 6 where queries and keys have 8; the output has the values' size."""
    saved, shape = _attention_saves("meta", 4, value_dim=6)

    assert shape == (2, 4, 16, 6)
    assert saved == 4096 + 4096 + 3072 + 3072 + 512  # q, k, v, output, log-sum-exp (fp32 per query)


def test_a_hugging_face_decoder_pipelined_with_sequence_parallelism_sends_its_slice_of_the_sequence():
    """Llama pp2 x tp2: with sequence parallelism a later stage receives (and builds its rotary positions for the
    whole sequence around) each tensor rank's half of the boundary; without, the whole boundary."""
    pytest.importorskip("transformers")
    from examples.nlp.hf_causal_lm import HFCausalLM

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)

    def last_stage(sequence_parallel: bool):
        sizes = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "microbatches": 2,
                 "sequence_parallel": sequence_parallel}
        found = simulate(partial(HFCausalLM, "llama", shape, vocab_size=64), options(**sizes), 4,
                         batch=partial(token_batch, 4, 64, True)).classes[-1]
        return {c["kind"]: c["bytes"] for c in found.collectives}, found.activation_bytes

    (whole, _), (sliced, saved) = last_stage(False), last_stage(True)
    assert sliced["recv"] * 2 == whole["recv"] == 2 * (2 * 64 * 32 * 4)  # 2 micro-batches of 2 x 64 x 32 fp32
    assert saved > 0
