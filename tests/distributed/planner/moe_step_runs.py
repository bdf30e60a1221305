"""Real 4-rank steps of MoE models under expert parallelism, counted with lp-simulate's own counter, and the same
layouts' simulated steps (``tests/distributed/planner/test_simulation_moe_step.py``).

Models: the GPT recipe's MoE (4 experts, top 2, every second block) and a Hugging Face Mixtral shape (4 experts,
top 2, ``output_router_logits=False``) through ``examples/nlp/hf_causal_lm.py``. The second step is counted: the first
also runs the experts' start-up load report (a gather of per-expert counts once, not part of a training step).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

from tests.distributed.planner.simulation_runs import MOE, WORLD, gpt
from tests.distributed.planner.step_runs import BATCH, SEQ, CountStep

VOCAB = 64
MIXTRAL = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": SEQ, "num_local_experts": 4,
           "num_experts_per_tok": 2, "output_router_logits": False}

# name -> (HybridParallelStrategy options, model: "gpt" or "mixtral")
MOE_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "gpt moe dp4 ep2 zero0": ({"data_parallel_size": 4, "expert_parallel_size": 2}, "gpt"),
    "gpt moe dp2 x cp2 ep4 zero3": ({"data_parallel_size": 2, "context_parallel_size": 2,
                                     "expert_parallel_size": 4, "zero_stage": 3}, "gpt"),
    "mixtral dp4 ep2 zero0": ({"data_parallel_size": 4, "expert_parallel_size": 2}, "mixtral"),
    "mixtral dp4 ep2 zero3": ({"data_parallel_size": 4, "expert_parallel_size": 2, "zero_stage": 3}, "mixtral"),
}


def model_factory(model: str) -> Any:
    """Builds the named model (a LightningModule with ``configure_optimizers``)."""
    if model == "gpt":
        return partial(gpt, moe=MOE)
    from examples.nlp.hf_causal_lm import HFCausalLM

    return partial(HFCausalLM, "mixtral", MIXTRAL, vocab_size=VOCAB,
                   optimizer=partial(torch.optim.AdamW, lr=1e-3), weight_decay=0.0)


class _AsDicts(torch.utils.data.Dataset):
    """Byte windows as a Hugging Face batch (``input_ids``, ``labels``; ids folded into the vocabulary), without an
    attention mask, as the simulation's batch."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, _ = self.windows[index]
        return {"input_ids": inputs % VOCAB, "labels": inputs % VOCAB}


def measure_moe_steps(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """Fit two steps of every named case; per case, this rank's second step's collectives and saved bytes."""
    from lightning_parallel import _compat
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData
    from tests.distributed.parity_runs import text_dataset

    out = {}
    for name in names:
        options, model = MOE_CASES[name]
        _compat.clear_dtensor_caches()  # one process runs every layout (tests/distributed/planner/step_runs.py)
        pl.seed_everything(0)
        counter = CountStep(step=1)
        strategy = HybridParallelStrategy(**{"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options})
        trainer = quiet_trainer(world_size, strategy, 2, [counter], limit_val_batches=0)
        windows = text_dataset(32, SEQ)
        dataset = windows if model == "gpt" else _AsDicts(windows)
        data = FixedOrderData(dataset, batch_size=BATCH // options["data_parallel_size"])
        trainer.fit(model_factory(model)(), datamodule=data)
        out[name] = {"collectives": counter.collectives, "activation_bytes": counter.activation_bytes}
    return out


def simulated_moe_step(name: str) -> Any:
    """The simulation of case ``name`` on :data:`WORLD` ranks with one step of the same batch."""
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner import simulate
    from lightning_parallel.planner.simulation.step import token_batch

    options, model = MOE_CASES[name]
    full = {"pipeline_parallel_size": 1, "tensor_parallel_size": 1, **options}
    per_rank = BATCH // options["data_parallel_size"]
    return simulate(model_factory(model), ParallelOptions(**full), WORLD,
                    batch=partial(token_batch, per_rank, SEQ, model != "gpt"))
