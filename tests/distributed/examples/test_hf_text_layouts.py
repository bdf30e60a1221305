"""``data=hf_text`` under every layout: packed rows of a folder's tokenizer give the one-process losses on every rank.

The test writes its corpus (JSONL prompt/response pairs and plain documents, plain text files; 3 to 400 tokens, so
rows hold one to many documents and long ones are cut), trains a word-level tokenizer with ``tokenizers`` and saves a
tiny Llama and a tiny Mixtral (4 experts, top 2) with it (:mod:`tests.hf_text_corpus`). Each case fine-tunes the
folder through the recipe's own module and data module (``HFCausalLM(pretrained=DIR)``, ``HFTextDataModule``; the
training loader is the resumable one, each data-parallel rank reading its rows): fp32, AdamW, clipping 0.5, 6 steps
of 8 rows of 32 tokens, then the validation split. Layouts on 2 ranks: data 2, pipeline 2 (2 micro-batches),
tensor 2, context 2 (ring and Ulysses), data 2 x expert 2 (Mixtral). Exact resume: data 2 stopped after step 3
mid-epoch, resumed under tensor 2 (data size 2 -> 1, the weights resharded): steps 4-6 are the uninterrupted ones.
Negative control: the same rows packed without document masks (position ids over the row) under context 2 ring.

One launch per world size serves every case (launches dominate the cost on this machine).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from lightning_parallel.strategies import HybridParallelStrategy  # noqa: E402
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes  # noqa: E402
from tests.distributed.parity_runs import run_recorded_cases  # noqa: E402
from tests.hf_text_corpus import corpus_and_model, save_model  # noqa: E402

pytestmark = pytest.mark.slow

SEQ, STEPS, GLOBAL_BATCH, RESUME_AT = 32, 6, 8, 3
TOL, CONTROL_GAP = 1e-5, 1e-4

# case -> (family, layout, options); options: "control" (no document masks), "save" / "resume" (the resume pair)
REFERENCES = {"llama": ("llama", "one_process", ""), "mixtral": ("mixtral", "one_process", "")}
TWO_PROCESS = {
    "llama/dp2": ("llama", "data=2", ""),
    "llama/pp2": ("llama", "pipeline=2,microbatches=2", ""),
    "llama/tp2": ("llama", "tensor=2", ""),
    "llama/cp2/ring": ("llama", "context=2,method=ring", ""),
    "llama/cp2/ulysses": ("llama", "context=2,method=ulysses", ""),
    "mixtral/dp2xep2": ("mixtral", "data=2,expert=2", ""),
    "control/llama/cp2/ring": ("llama", "context=2,method=ring", "control"),
    "resume/llama/dp2": ("llama", "data=2", "save"),  # stops after step 3 and saves
    "resume/llama/dp2->tp2": ("llama", "tensor=2", "resume"),  # resumes that checkpoint
}


def _strategy(layout: str) -> tuple[HybridParallelStrategy, int]:
    sizes = {} if layout == "one_process" else dict(part.split("=") for part in layout.split(","))
    kwargs = {"context_parallel_method": sizes.pop("method", "ring"), "microbatches": int(sizes.pop("microbatches", 1))}
    kwargs.update({f"{axis}_parallel_size": int(n) for axis, n in sizes.items()})
    for axis in ("data", "pipeline", "tensor"):
        kwargs.setdefault(f"{axis}_parallel_size", 1)
    return HybridParallelStrategy(**kwargs), kwargs["data_parallel_size"]


def fit_hf_text(family: str, layout: str, option: str, root: str, world_size: int) -> dict[str, list[float]]:
    """Fine-tune ``root/model_<family>`` on ``root/data`` under ``layout``; every step's losses and the val loss."""
    from examples.nlp.hf_causal_lm import HFCausalLM
    from examples.nlp.hf_text import HFTextDataModule

    pl.seed_everything(0)
    history = LossHistory()
    strategy, data_parallel = _strategy(layout)
    callbacks: list = [history]
    if option == "save":  # saved during the fit, as lp-train does (a checkpoint after fit returned lacks the loader)
        callbacks.append(ModelCheckpoint(dirpath=root, filename="resume", every_n_train_steps=RESUME_AT))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, callbacks=callbacks,
                         max_steps=RESUME_AT if option == "save" else STEPS, gradient_clip_val=0.5, logger=False,
                         enable_checkpointing=option == "save", enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    data = HFTextDataModule(
        files=[f"{root}/data/corpus.jsonl", f"{root}/data/texts"], tokenizer=f"{root}/model_{family}",
        seq_len=SEQ, batch_size=GLOBAL_BATCH // data_parallel, val_every=6, max_val_batches=2,
        cache_dir=f"{root}/cache", document_masks=option != "control")
    model = HFCausalLM(pretrained=f"{root}/model_{family}", vocab_size=None, warmup_steps=0, max_steps=0)
    checkpoint = f"{root}/resume.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=checkpoint if option == "resume" else None)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    return {"reduced": history.losses, "local": history.local_losses, "val": [float(val)]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hf_text")
    _, llama = corpus_and_model(folder, "llama")
    from transformers import AutoTokenizer

    save_model(folder / "model_mixtral", AutoTokenizer.from_pretrained(llama), "mixtral")
    return str(folder)


@pytest.fixture(scope="module")
def references(root) -> dict:
    cases = {name: (*case, root) for name, case in REFERENCES.items()}
    return run_processes(run_recorded_cases, 1, fit_hf_text, cases, timeout=600)[0]


@pytest.fixture(scope="module")
def two_process_runs(root, references) -> list[dict]:
    cases = {name: (*case, root) for name, case in TWO_PROCESS.items()}
    return run_processes(run_recorded_cases, 2, fit_hf_text, cases, timeout=1200)


def _worst(results: dict, reference: dict, first_step: int = 0) -> float:
    worst = 0.0
    for value in ("reduced", "local"):  # the suite's mean of the global batch, and the rank's own number
        worst = max(worst, max_abs_difference(results[value], reference["reduced"][first_step:]))
    return max(worst, max_abs_difference(results["val"], reference["val"]))


@pytest.mark.parametrize("case", [c for c in TWO_PROCESS if not c.startswith(("control/", "resume/"))])
def test_packed_rows_train_as_one_process_on_every_rank(references, two_process_runs, case):
    reference = references[TWO_PROCESS[case][0]]
    assert not isinstance(reference, str), reference
    assert reference["reduced"][-1] < reference["reduced"][0]  # it learns
    for rank, runs in enumerate(two_process_runs):
        assert not isinstance(runs[case], str), f"{case} rank {rank} failed: {runs[case]}"
        worst = _worst(runs[case], reference)
        print(f"{case} rank {rank}: max |loss - one process| {worst:.2e} (train and val)")
        assert worst < TOL, f"{case} rank {rank}: {worst:.2e}"


def test_packing_without_document_masks_is_caught(references, two_process_runs):
    for rank, runs in enumerate(two_process_runs):
        results = runs["control/llama/cp2/ring"]
        assert not isinstance(results, str), results
        diff = max_abs_difference(results["reduced"], references["llama"]["reduced"])
        print(f"control rank {rank}: documents seeing each other moves the losses by {diff:.2e}")
        assert diff > CONTROL_GAP


def test_resumed_mid_epoch_at_another_layout_continues_with_the_next_batches(references, two_process_runs):
    reference = references["llama"]
    for rank, runs in enumerate(two_process_runs):
        first, resumed = runs["resume/llama/dp2"], runs["resume/llama/dp2->tp2"]
        assert not isinstance(first, str) and not isinstance(resumed, str), (first, resumed)
        assert len(first["reduced"]) == RESUME_AT and len(resumed["reduced"]) == STEPS - RESUME_AT
        before = max_abs_difference(first["reduced"], reference["reduced"][:RESUME_AT])
        after = _worst(resumed, reference, RESUME_AT)
        print(f"rank {rank}: dp2 steps 1-{RESUME_AT} {before:.2e}, resumed under tp2 steps {RESUME_AT + 1}-{STEPS} "
              f"{after:.2e} from the uninterrupted one process")
        assert before < TOL and after < TOL
