"""A Hugging Face decoder under pipeline 2 x tensor 2 with ``sequence_parallel=True`` trains as without it.

Under sequence parallelism the residual stream between decoder layers holds each tensor rank's slice of the sequence,
so a later pipeline stage receives a slice. It builds its rotary positions and masks from the batch's position ids
(given to every stage) and the whole sequence's length, not from the slice: before, it built them for half the
sequence and the first attention failed (``The size of tensor a (16) must match the size of tensor b (8)``).
Llama with eager attention (the mask is applied) on right-padded rows, AdamW, 4 steps: every rank's losses equal the
same layout's without sequence parallelism within 1e-5."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.testing import run_processes

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = [pytest.mark.slow, pytest.mark.extended]  # one 4-rank launch of two fits: about 40 s here

STEPS, BATCH, SEQ, VOCAB = 4, 4, 16, 64
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=SEQ, pad_token_id=0, tie_word_embeddings=False)


class UserModule(pl.LightningModule):
    """A transformers Llama and its own loss (eager attention: the stages' masks are applied)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("llama", **SHAPE)
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def padded_rows() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(STEPS * BATCH):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=generator)
        mask = (torch.arange(SEQ) < SEQ - (i % 2) * 4).long()  # 16 or 12 valid tokens
        rows.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
                     "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def fit_both(rank: int, world_size: int) -> dict[bool, Any]:
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing import LossHistory
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.models import FixedOrderData

    out = {}
    for sequence_parallel in (False, True):
        pl.seed_everything(0)
        history = LossHistory()
        strategy = HybridParallelStrategy(data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=2,
                                          sequence_parallel=sequence_parallel, microbatches=2)
        trainer = quiet_trainer(world_size, strategy, STEPS, [history], limit_val_batches=0)
        trainer.fit(UserModule(), datamodule=FixedOrderData(padded_rows(), batch_size=BATCH))
        out[sequence_parallel] = history.losses
    return out


def test_sequence_parallel_under_pipelining_gives_the_losses_without_it():
    ranks = run_processes(fit_both, 4, timeout=600)

    for rank, losses in enumerate(ranks):
        assert len(losses[True]) == STEPS, rank
        worst = max(abs(a - b) for a, b in zip(losses[True], losses[False]))
        print(f"rank {rank}: max |loss with sp - without| = {worst:.2e}")
        assert worst < 1e-5, (rank, losses)
