"""A Hugging Face decoder built in ``configure_model`` is never held whole: it is split on ``meta`` and each rank
allocates and initialises only its share, with the model's own initialiser (``_init_weights``: its
``initializer_range``, norms at one, rotary frequencies from the config), and trains exactly as one process.

The reference builds the same module with storage under Lightning's own single-device strategy and gives it the
per-module seeded initialisation (``protocol.seeded_init`` with the adapter's initialiser). Qwen2 ties its LM
head to the embedding: on a pipeline stage holding only the head, the head must start from the embedding's
value, and where one rank holds both they must stay one parameter.
"""

from functools import partial

import pytest
import torch

from examples.nlp.hf_causal_lm import HFCausalLM
from examples.nlp.hf_data import PaddedTextDataModule
from lightning_parallel.adapters import adapt
from lightning_parallel.protocol import seeded_init
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import Case, Layout, compare_cases
from lightning_parallel.testing.assertions import check_comparison

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN, STEPS, TOLERANCE = 8, 32, 4, 1e-5


class BuiltInConfigureModel(HFCausalLM):
    """The recipe's module with the model created in ``configure_model`` (Lightning's recipe for large models)."""

    def __init__(self, family: str) -> None:
        pl_init = super(HFCausalLM, self).__init__
        pl_init()
        self.family = family
        self.optimizer_factory = partial(torch.optim.AdamW, lr=1e-3)
        self.hparams.update(weight_decay=0.01, warmup_steps=0, max_steps=0)

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        from examples.nlp.hf_causal_lm import _transformers, build_config

        cfg = build_config(self.family, {}, 128)
        self.model = _transformers().AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        if not next(self.model.parameters()).is_meta:  # built with storage (Lightning's own strategies)
            seeded_init(self, torch.initial_seed(), adapt(self).init_module)
        self.full_elements = sum(p.numel() for p in self.model.parameters())

    def on_train_start(self) -> None:
        stored = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self.model.parameters())
        if self.trainer.world_size > 1:
            assert stored < self.full_elements, f"a rank holds all {self.full_elements} elements"
        head = getattr(self.model.lm_head, "weight", None)  # a pipeline stage may hold either or neither
        embedding = getattr(self.model.model.embed_tokens, "weight", None)
        if self.model.config.tie_word_embeddings and head is not None and embedding is not None:
            assert head is embedding, "the tied embedding and LM head became two parameters"


def padded_documents(layout=None) -> PaddedTextDataModule:
    data_parallel = layout.data_parallel if layout is not None else 1
    return PaddedTextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // data_parallel, max_bytes=40_000)


def test_meta_built_decoders_match_one_process_on_every_layout():
    families = ("llama", "qwen2")
    cases = {family: Case(partial(BuiltInConfigureModel, family), padded_documents, {}) for family in families}
    layouts = [
        Layout("auto", 1, "1 process, eager + seeded_init"),
        Layout(partial(Hybrid, pipeline_parallel_size=2, data_parallel_size=1, microbatches=4), 2, "pp2"),
        Layout(partial(Hybrid, tensor_parallel_size=2, data_parallel_size=1), 2, "tp2"),
        Layout(partial(Hybrid, data_parallel_size=2, zero_stage=3), 2, "dp2 zero3"),
    ]
    for family, result in compare_cases(cases, layouts, STEPS, TOLERANCE, timeout=900).items():
        check_comparison(result, family)
