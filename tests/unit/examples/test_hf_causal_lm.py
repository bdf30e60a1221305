"""The Hugging Face recipe: tiny configs by family or folder, a module with no glue, padded documents."""

import sys

import pytest
import torch

from examples.nlp.hf_data import IGNORE_INDEX, PaddedDocuments

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

from examples.nlp.hf_causal_lm import FAMILY_DEFAULTS, HFCausalLM, build_config  # noqa: E402

PROTOCOL_METHODS = ("pipeline_layers", "pipeline_loss", "pipeline_loss_terms", "pipeline_split_batch",
                    "tensor_parallel_plan")


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_family_builds_a_tiny_random_model_with_no_protocol_method(family):
    module = HFCausalLM(family).build()
    cfg = module.model.config
    assert cfg.model_type == family and cfg.vocab_size == 128 and cfg.num_hidden_layers == 4
    assert sum(p.numel() for p in module.parameters()) < 100_000
    assert cfg.tie_word_embeddings == (family == "qwen2")
    assert not [name for name in PROTOCOL_METHODS if hasattr(module, name)]


def test_config_from_a_local_folder_keeps_its_shape_and_takes_overrides(tmp_path):
    transformers.AutoConfig.for_model("mistral", hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=96, num_hidden_layers=2).save_pretrained(tmp_path)
    cfg = build_config(str(tmp_path), {"num_hidden_layers": 3}, vocab_size=64)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("mistral", 48, 3, 64)


@pytest.mark.parametrize(("config", "needle"), [("no_such_family", "local save_pretrained folder"),
                                                 ("t5", "encoder-decoder")])
def test_unusable_config_is_a_value_error_naming_the_fix(config, needle):
    with pytest.raises(ValueError, match=needle):
        build_config(config)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an environment without the extra sees
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        build_config("llama")


def test_training_step_is_the_models_mean_over_valid_tokens():
    torch.manual_seed(0)
    module = HFCausalLM("llama").build()
    documents = PaddedDocuments(torch.randint(32, 127, (4 * 16,)), seq_len=16, vocab_size=128)
    batch = torch.utils.data.default_collate([documents[i] for i in range(4)])
    logits = module(batch["input_ids"], batch["attention_mask"])
    targets = batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 128), targets.reshape(-1), ignore_index=-100
    )
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    assert torch.allclose(module.training_step(batch, 0), expected, atol=1e-6)


def test_padded_documents_vary_in_length_and_mask_their_padding():
    data = torch.arange(40 * 32) % 256  # every byte value, including those above the vocabulary
    documents = PaddedDocuments(data, seq_len=32, vocab_size=128, min_length=8, pad_token_id=0)
    lengths = []
    for i in range(len(documents)):
        sample = documents[i]
        length = int(sample["attention_mask"].sum())
        assert 8 <= length <= 32 and sample["attention_mask"][:length].all()  # right padding
        assert (sample["labels"] == IGNORE_INDEX).sum() == 32 - length
        assert (sample["input_ids"][length:] == 0).all() and int(sample["input_ids"].max()) < 128
        assert torch.equal(sample["labels"][:length], sample["input_ids"][:length])
        lengths.append(length)
    assert len(set(lengths)) > 10
    again = PaddedDocuments(data, seq_len=32, vocab_size=128, min_length=8)
    assert all(torch.equal(again[i]["labels"], documents[i]["labels"]) for i in range(len(documents)))


@pytest.mark.parametrize(
    ("kwargs", "needle"), [({"min_length": 1}, "min_length=1"), ({"pad_token_id": 200}, "pad_token_id")]
)
def test_padded_documents_refuse_bad_settings(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PaddedDocuments(torch.zeros(64, dtype=torch.long), seq_len=16, vocab_size=128, **kwargs)
