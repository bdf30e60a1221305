"""``lp-train experiment=hf_finetune model.pretrained=DIR data.files=...`` as a user runs it, on files, a tokenizer
and a tiny decoder the test writes (:mod:`tests.hf_text_corpus`): packed rows give one process's losses on every
rank within 1e-5, under data 2 and context 2 (Ulysses) for a Llama and data 2 x expert 2 for a Mixtral.

Five ``lp-train`` runs (each 20-60 s here); the other layouts, the negative control and the exact resume are covered
in-process by tests/distributed/examples/test_hf_text_layouts.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from lightning_parallel.testing import max_abs_difference  # noqa: E402
from tests.hf_text_corpus import corpus_and_model, save_model  # noqa: E402
from tests.integration.lp_train_runs import lp_train, ok  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-5
RUN = ["trainer.max_steps=5", "trainer.val_check_interval=5", "trainer.enable_progress_bar=false", "logger=none",
       "data.seq_len=32", "data.val_every=6", "data.max_val_batches=1", "model.warmup_steps=2",
       "model.optimizer.lr=3e-3", "trainer.gradient_clip_val=0.5"]
# name -> (family, devices, overrides); data.batch_size is per data-parallel rank: 8 rows per step in every cell
CELLS = {
    "llama/one_process": ("llama", 1, ["data.batch_size=8"]),
    "llama/dp2": ("llama", 2, ["data.batch_size=4"]),
    "llama/cp2/ulysses": ("llama", 2, ["data.batch_size=8", "strategy.context_parallel_size=2",
                                       "strategy.context_parallel_method=ulysses"]),
    "mixtral/one_process": ("mixtral", 1, ["data.batch_size=8"]),
    "mixtral/dp2xep2": ("mixtral", 2, ["data.batch_size=4", "strategy.expert_parallel_size=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("hf_finetune")
    corpus, llama = corpus_and_model(root, "llama")
    from transformers import AutoTokenizer

    save_model(root / "model_mixtral", AutoTokenizer.from_pretrained(llama), "mixtral")
    files = f"data.files=[{corpus['jsonl']},{corpus['texts']}]"
    out = {}
    for name, (family, devices, strategy) in CELLS.items():
        losses = root / "losses" / name.replace("/", "_")
        args = ["experiment=hf_finetune", f"model.pretrained={root / f'model_{family}'}", files, *RUN,
                f"trainer.devices={devices}", *strategy, f"data.cache_dir={root / 'cache'}",
                f"hydra.run.dir={root / 'runs' / name.replace('/', '_')}",
                "+callbacks.losses._target_=tests.integration.hf_finetune_runs.RankLosses",
                f"+callbacks.losses.folder={losses}"]
        ok(lp_train(args, cwd=root, timeout=600))
        out[name] = [json.loads((losses / f"rank{r}.json").read_text()) for r in range(devices)]
    return out


@pytest.mark.parametrize("cell", [c for c in CELLS if not c.endswith("one_process")])
def test_lp_train_hf_finetune_gives_one_process_losses_on_every_rank(runs, cell):
    reference = runs[f"{CELLS[cell][0]}/one_process"][0]["reduced"]
    assert len(reference) == 5 and reference[-1] < reference[0]  # it fine-tunes
    for rank, losses in enumerate(runs[cell]):
        worst = max(max_abs_difference(losses[kind], reference) for kind in ("reduced", "local"))
        print(f"lp-train {cell} rank {rank}: max |loss - one process| {worst:.2e}")
        assert worst < TOL, f"{cell} rank {rank}: {worst:.2e}"
