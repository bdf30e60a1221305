"""The planner's memory formulas against ``lp-simulate`` at 4 ranks: for each layout the parameter, gradient and
optimizer bytes (AdamW's step counters included) and FSDP2's gathered units of the most loaded rank are the
simulation's to the byte (the DDP path gathers nothing), and the activations are within 5% (ring attention keeps a
little more than ``1 / cp`` of the layer's saves)."""

from functools import partial

import pytest
import torch

from examples.nlp.model import GPT
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.planner import simulate
from lightning_parallel.planner.candidates import Candidate
from lightning_parallel.planner.memory import activation_bytes, stage_layers, state_bytes, working_bytes
from lightning_parallel.planner.profile import profile_module
from lightning_parallel.planner.simulation.step import token_batch

tiny = partial(GPT, d_model=32, n_head=2, n_layer=2, seq_len=64, optimizer=partial(torch.optim.AdamW, lr=1e-3),
               warmup_steps=0)
BATCH, SEQ = 8, 64

# name -> (ParallelOptions sizes, the planner's Candidate fields)
LAYOUTS = {
    "dp4 zero0 (DDP)": ({"data_parallel_size": 4}, {"dp": 4, "zero": 0}),
    "dp4 zero2": ({"data_parallel_size": 4, "zero_stage": 2}, {"dp": 4, "zero": 2}),
    "dp4 zero3": ({"data_parallel_size": 4, "zero_stage": 3}, {"dp": 4, "zero": 3}),
    "dp2 x tp2 zero3": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 3},
                        {"dp": 2, "tp": 2, "zero": 3}),
    "dp2 x cp2 zero2": ({"data_parallel_size": 2, "context_parallel_size": 2, "zero_stage": 2},
                        {"dp": 2, "cp": 2, "zero": 2, "cp_method": "ring"}),
    "dp2 x cp2 zero0 (DDP)": ({"data_parallel_size": 2, "context_parallel_size": 2},
                              {"dp": 2, "cp": 2, "zero": 0, "cp_method": "ring"}),
    "dp4 zero3 full checkpointing": ({"data_parallel_size": 4, "zero_stage": 3, "activation_checkpointing": "full"},
                                     {"dp": 4, "zero": 3, "checkpointing": "full"}),
}


@pytest.fixture(scope="module")
def shape():
    torch.manual_seed(0)
    model = tiny()
    model.configure_model()  # the recipe creates its layers there
    return profile_module(model, torch.zeros(2, SEQ, dtype=torch.long))


@pytest.mark.parametrize("name", LAYOUTS)
def test_predicted_memory_is_the_simulated_at_four_ranks(name, shape):
    sizes, fields = LAYOUTS[name]
    per_rank = BATCH // sizes["data_parallel_size"]
    candidate = Candidate(**{"engine": "hybrid", "pp": 1, "tp": 1, "schedule": "-", "stages_per_rank": 1,
                             "microbatches": 1, "batch_size": per_rank, "accumulate": 1, "global_batch": BATCH,
                             **fields})
    layers = stage_layers(shape, candidate)[0][0]
    simulation = simulate(tiny, ParallelOptions(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **sizes}),
                          4, batch=partial(token_batch, per_rank, SEQ))
    top = max(simulation.classes, key=lambda c: c.parameter_bytes + c.gradient_bytes + c.optimizer_bytes)

    simulated = (top.parameter_bytes, top.gradient_bytes, top.optimizer_bytes)
    assert tuple(int(b) for b in state_bytes(shape, candidate, layers)) == simulated
    assert working_bytes(shape, candidate, layers) == top.gathered_bytes
    predicted = sum(activation_bytes(shape, candidate, i, per_rank) for i in layers)
    assert abs(predicted - top.activation_bytes) <= 0.05 * top.activation_bytes, (predicted, top.activation_bytes)
