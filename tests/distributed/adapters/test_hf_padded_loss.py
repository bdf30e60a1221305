"""Padded batches, a Hugging Face Llama and no glue: 2 data-parallel processes give the one-process loss.

The user's module holds a random-init ``LlamaForCausalLM`` and returns ``self.model(**batch).loss``
(no protocol method). Batches are right-padded with ``-100`` on the padding and on a prompt
prefix; rank 0 draws short rows and rank 1 long ones, so the valid-token counts differ per
rank and per step. Every data-parallel layout must give the single-process loss on every
rank, both the reduced value the suite's comparisons read and the rank's own returned value.
The negative control passes each rank's own count as ``num_items_in_batch`` (the suite then
leaves the loss alone): the plain per-rank mean, which must fail the comparison.

The GPT recipe (its own ``pipeline_loss_terms``) is held to the same rule on padded targets,
directly under data parallelism and pipelined under dp2 x pp2 (where the strategy counts the
global batch's valid tokens and the schedule divides by them).

Launches dominate the cost on this machine: one 1-process launch computes every reference,
one 2-process launch runs every 2-process layout in turn, one 4-process launch the pipeline.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters.hf.model import causal_lm_valid_count  # noqa: E402
from lightning_parallel.strategies import HybridParallelStrategy  # noqa: E402
from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy  # noqa: E402
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes  # noqa: E402
from lightning_parallel.testing.fit import quiet_trainer  # noqa: E402
from lightning_parallel.testing.models import FixedOrderData  # noqa: E402
from tests.distributed.parity_runs import run_recorded_cases  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB, SEQ, STEPS, GLOBAL_BATCH, SAMPLES = 64, 16, 8, 8, 128
TOL, CONTROL_GAP = 1e-5, 1e-4
CLIP = {"gradient_clip_val": 0.5}
ACCUMULATE = {**CLIP, "accumulate_grad_batches": 2}


class PaddedLM(pl.LightningModule):
    """What a user writes: a transformers model and ``model(**batch).loss`` (no protocol method).

    Args:
        per_rank_mean: pass this rank's own valid-token count (the negative control).
    """

    def __init__(self, per_rank_mean: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ,
        )
        self.model = transformers.LlamaForCausalLM(config)
        self.per_rank_mean = per_rank_mean

    def training_step(self, batch, batch_idx):
        if self.per_rank_mean:
            return self.model(**batch, num_items_in_batch=causal_lm_valid_count(batch["labels"])).loss
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def padded_samples() -> list[dict[str, torch.Tensor]]:
    """Right-padded rows; even rows (rank 0's under 2-way data parallelism) short, odd rows long."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(SAMPLES):
        length = 3 + i % 5 if i % 2 == 0 else 9 + i % 8
        start = int(torch.randint(1, VOCAB, (1,), generator=gen))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = (start + torch.arange(length)) % (VOCAB - 1) + 1  # counting up: learnable in a few steps
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[: i % 3] = -100  # a prompt prefix without loss
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def padded_text() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Byte windows whose targets carry -100 after a per-row length (short on even rows) and on a prefix."""
    from tests.distributed.parity_runs import text_dataset

    rows = []
    for i, (inputs, targets) in enumerate(text_dataset(SAMPLES // 2, SEQ)):
        targets = targets.clone()
        targets[(3 + i % 5 if i % 2 == 0 else 12 + i % 4):] = -100
        targets[: i % 3] = -100
        rows.append((inputs, targets))
    return rows


def gpt(per_micro_batch_mean: bool = False) -> pl.LightningModule:
    """The tiny GPT recipe; with ``per_micro_batch_mean`` as it was before (the negative control)."""
    from examples.nlp.model import GPT
    from tests.distributed.parity_runs import tiny_gpt

    class MeanGPT(GPT):
        pipeline_loss_terms = None  # no terms: the pipeline falls back to the per-micro-batch mean (pipelined only)

        def pipeline_loss(self, output, target):
            return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(0, 1), ignore_index=-100)

    model = tiny_gpt()
    if not per_micro_batch_mean:
        return model
    control = MeanGPT(**dict(model.hparams), optimizer=model.optimizer_factory)
    control.load_state_dict(model.state_dict())
    return control


STRATEGIES = {
    "one_process": lambda: "auto",
    "hybrid_dp2": lambda: HybridParallelStrategy(data_parallel_size=2),
    "hybrid_dp2_zero2": lambda: HybridParallelStrategy(data_parallel_size=2, zero_stage=2),
    "deepspeed_zero2": lambda: DeepSpeedDataParallelStrategy(zero_stage=2),
    "deepspeed_zero3": lambda: DeepSpeedDataParallelStrategy(zero_stage=3),
    "dp2xpp2": lambda: HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2),
}
# model -> (module factory taking the control flag, samples)
MODELS = {"llama": (PaddedLM, padded_samples), "gpt": (gpt, padded_text)}
# case -> (model, strategy, trainer arguments, negative control); a case's reference is named by its suffix
REFERENCES = {"llama": ("llama", "one_process", CLIP, False),
              "llama/accumulate": ("llama", "one_process", ACCUMULATE, False),
              "gpt": ("gpt", "one_process", CLIP, False)}
TWO_PROCESS = {
    "llama/hybrid_dp2": ("llama", "hybrid_dp2", CLIP, False),
    "llama/hybrid_dp2_zero2": ("llama", "hybrid_dp2_zero2", CLIP, False),
    "llama/deepspeed_zero2": ("llama", "deepspeed_zero2", CLIP, False),
    "llama/deepspeed_zero3": ("llama", "deepspeed_zero3", CLIP, False),
    "llama/deepspeed_zero2/accumulate": ("llama", "deepspeed_zero2", ACCUMULATE, False),
    "gpt/hybrid_dp2": ("gpt", "hybrid_dp2", CLIP, False),
    "control/llama/deepspeed_zero2": ("llama", "deepspeed_zero2", CLIP, True),
}
FOUR_PROCESS = {
    "gpt/dp2xpp2": ("gpt", "dp2xpp2", CLIP, False),
    "control/gpt/dp2xpp2": ("gpt", "dp2xpp2", CLIP, True),
}


def _fit(model: str, strategy: str, trainer_kwargs: dict, control: bool, world_size: int) -> dict[str, list[float]]:
    pl.seed_everything(0)
    history = LossHistory()
    trainer = quiet_trainer(world_size, STRATEGIES[strategy](), STEPS, [history], **trainer_kwargs)
    factory, samples = MODELS[model]
    data_parallel = 1 if strategy == "one_process" else 2
    trainer.fit(factory(control), datamodule=FixedOrderData(samples(), batch_size=GLOBAL_BATCH // data_parallel))
    return {"reduced": history.losses, "local": history.local_losses}


def _reference(references: dict, case: str) -> list[float]:
    name = case.removeprefix("control/").split("/")[0] + ("/accumulate" if case.endswith("/accumulate") else "")
    return references[name]["reduced"]


@pytest.fixture(scope="module")
def references() -> dict:
    return run_processes(run_recorded_cases, 1, _fit, REFERENCES)[0]


@pytest.fixture(scope="module")
def two_process_runs() -> list[dict]:
    return run_processes(run_recorded_cases, 2, _fit, TWO_PROCESS, timeout=900)


def _check_parity(references: dict, per_rank: list[dict], case: str) -> None:
    reference = _reference(references, case)
    assert reference[-1] < reference[0]  # it trained
    for rank, results in enumerate(per_rank):
        assert not isinstance(results[case], str), f"{case} rank {rank} failed: {results[case]}"
        for value in ("reduced", "local"):  # the suite's data-parallel mean, and the rank's own number
            diff = max_abs_difference(results[case][value], reference)
            assert diff < TOL, f"{case} rank {rank} {value}: max |diff| {diff:.2e}"


DIRECT_CASES = [c for c in TWO_PROCESS if not c.startswith("control/")]


@pytest.mark.parametrize("case", DIRECT_CASES)
def test_every_rank_matches_one_process_on_padded_batches(references, two_process_runs, case):
    _check_parity(references, two_process_runs, case)


def test_negative_control_the_per_rank_mean_fails_the_comparison(references, two_process_runs):
    case = "control/llama/deepspeed_zero2"
    for results in two_process_runs:
        assert max_abs_difference(results[case]["reduced"], _reference(references, case)) > CONTROL_GAP
    # Each rank averaged its own tokens: the ranks disagree on the loss they return.
    assert max_abs_difference(two_process_runs[0][case]["local"], two_process_runs[1][case]["local"]) > CONTROL_GAP


def test_pipelined_gpt_counts_the_global_batch_and_matches_one_process(references):
    per_rank = run_processes(run_recorded_cases, 4, _fit, FOUR_PROCESS, timeout=900)
    _check_parity(references, per_rank, "gpt/dp2xpp2")
    # Negative control: per-micro-batch means, averaged, miss the padded comparison.
    for results in per_rank:
        control = max_abs_difference(results["control/gpt/dp2xpp2"]["reduced"], _reference(references, "gpt"))
        assert control > CONTROL_GAP
