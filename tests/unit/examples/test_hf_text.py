"""``data=hf_text`` without processes: rows, masks and labels from the test's own corpus and tokenizer.

Packed rows are full, keep every document whole (cut only past ``seq_len``), restart position ids per document and
carry no loss on a document's first token or a prompt; a model gives each document the same token losses packed as
alone in a padded row (and not without document masks); JSONL, Parquet, ``save_to_disk`` folders and plain text read
the same; rows are cached once; mistakes are refused with the fix.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from examples.nlp.hf_text import HFTextDataModule  # noqa: E402
from examples.nlp.packing import IGNORE_INDEX, pack_rows, position_ids  # noqa: E402
from examples.nlp.text_files import FolderTokenizer, RecordEncoder, expand_files, read_records  # noqa: E402
from tests.hf_text_corpus import corpus_and_model  # noqa: E402

SEQ = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_text_unit")
    corpus, model = corpus_and_model(root)
    return root, corpus, model


def _data(folders, **kwargs) -> HFTextDataModule:
    root, corpus, model = folders
    options = dict(files=[str(corpus["jsonl"]), str(corpus["texts"])], tokenizer=str(model), seq_len=SEQ,
                   batch_size=4, val_every=0, cache_dir=str(root / "cache"))
    data = HFTextDataModule(**{**options, **kwargs})
    data.setup()
    return data


def _documents(folders) -> list:
    _, corpus, model = folders
    encoder = RecordEncoder(FolderTokenizer(model))
    return list(encoder.documents(read_records(expand_files([str(corpus["jsonl"]), str(corpus["texts"])]))))


def test_packed_rows_are_full_keep_documents_whole_and_restart_positions(folders):
    documents = _documents(folders)
    rows = list(pack_rows(documents, SEQ, pad_id=0))
    unpacked = list(pack_rows(documents, SEQ, pad_id=0, packing=False))
    fill, padded_fill = (sum(int((r[2] > 0).sum()) for r in rs) / (len(rs) * SEQ) for rs in (rows, unpacked))
    print(f"{len(documents)} documents: {len(rows)} packed rows ({fill:.1%} document tokens), {len(unpacked)} padded "
          f"({padded_fill:.1%})")
    assert fill > 0.95 and padded_fill < 0.8
    assert max(len(d[0]) for d in documents) > SEQ > min(len(d[0]) for d in documents)  # cut and short ones
    pieces = sorted(tuple(r[0][r[2] == s]) for r in unpacked for s in range(1, 2))
    packed = sorted(tuple(r[0][r[2] == s]) for r in rows for s in range(1, int(r[2].max()) + 1))
    assert pieces == packed  # the same pieces, whole, in other rows
    for row in rows:
        segments = torch.from_numpy(row[2]).long()
        positions = position_ids(segments)
        starts = torch.nonzero(positions == 0).flatten()
        assert (row[1][starts.numpy()] == IGNORE_INDEX).all()  # no token predicts the next document's first
        assert (row[1][row[2] == 0] == IGNORE_INDEX).all()  # padding carries no loss
        assert torch.equal(position_ids(segments, document_masks=False), torch.arange(SEQ))


def test_prompt_tokens_carry_no_loss_and_responses_do(folders):
    _, corpus, model = folders
    tokenizer = FolderTokenizer(model)
    records = [json.loads(line) for line in corpus["jsonl"].read_text().splitlines()]
    pairs = [r for r in records if "prompt" in r][:5]
    for record, (ids, labels) in zip(pairs, RecordEncoder(tokenizer).encode(pairs)):
        prompt = tokenizer.encode([record["prompt"]], special=True)[0]
        response = tokenizer.encode([record["response"]], special=False)[0] + [tokenizer.eos_id]
        assert ids.tolist() == prompt + response
        assert (labels[:len(prompt)] == IGNORE_INDEX).all() and labels[len(prompt):].tolist() == response


def _document_losses(model, batches: list[dict], leak: bool = False) -> dict[tuple, list[float]]:
    """Each document's summed token loss, keyed by its tokens (documents: position ids restarting, or rows).
    ``leak``: the model gets position ids over the whole row (packing without document masks)."""
    out: dict[tuple, list[float]] = defaultdict(list)
    for batch in batches:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if leak:
            inputs["position_ids"] = position_ids(inputs["position_ids"], document_masks=False)
        with torch.no_grad():
            logits = model(**inputs).logits
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                                   reduction="none", ignore_index=IGNORE_INDEX)
        starts = batch["position_ids"] == 0 if "position_ids" in batch else torch.zeros_like(batch["labels"]).bool()
        documents = starts.long().cumsum(-1) if "position_ids" in batch else batch["attention_mask"]
        for row in range(len(losses)):
            for doc in documents[row].unique().tolist():
                where = documents[row] == doc
                if "attention_mask" in batch and doc == 0 or not (batch["labels"][row][where] >= 0).any():
                    continue  # padding
                key = tuple(batch["input_ids"][row][where].tolist())
                out[key].append(float(losses[row][where[1:]].sum()))
    return {key: sorted(values) for key, values in out.items()}


def test_packed_and_unpacked_documents_have_the_same_token_losses(folders):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folders[2]).eval()
    model.config.use_cache = False  # as HFCausalLM trains: transformers separates packed documents only then
    unpacked = _data(folders, packing=False)
    padded = _document_losses(model, unpacked.batches(len(unpacked.train_rows)))
    assert set(unpacked.batches(1)[0]) == {"input_ids", "attention_mask", "labels"}
    packed_data = _data(folders)
    packed = _document_losses(model, packed_data.batches(len(packed_data.train_rows)))
    assert set(packed) == set(padded) and len(packed) > 20
    worst = max(abs(a - b) for key in packed for a, b in zip(packed[key], padded[key]))
    leaking = _document_losses(model, packed_data.batches(len(packed_data.train_rows)), leak=True)
    moved = max(abs(a - b) for key in leaking for a, b in zip(leaking[key], padded[key]))
    print(f"{len(packed)} documents: packed vs alone {worst:.1e} (summed token losses); "
          f"without document masks {moved:.2f}")
    assert worst < 1e-4 and moved > 1e-2


def test_jsonl_parquet_arrow_folders_and_text_files_read_the_same_documents(folders, tmp_path):
    root, corpus, model = folders
    records = [json.loads(line) for line in corpus["jsonl"].read_text().splitlines()]
    fields = ("text", "prompt", "response")  # from_list takes the first record's keys: every record has all three
    table = datasets.Dataset.from_list([{key: record.get(key) for key in fields} for record in records])
    table.to_parquet(str(tmp_path / "corpus.parquet"))
    table.save_to_disk(str(tmp_path / "arrow"))
    encoder = RecordEncoder(FolderTokenizer(model))
    read = {name: [d[0].tolist() for d in encoder.documents(read_records(expand_files(str(path))))]
            for name, path in [("jsonl", corpus["jsonl"]), ("parquet", tmp_path / "corpus.parquet"),
                               ("arrow", tmp_path / "arrow")]}
    assert read["jsonl"] == read["parquet"] == read["arrow"] and len(read["jsonl"]) == len(records)
    texts = sorted(Path(corpus["texts"]).glob("*.txt"))
    from_files = [d[0].tolist() for d in encoder.documents(read_records(expand_files(str(corpus["texts"]))))]
    expected = [FolderTokenizer(model).encode([t.read_text()], special=True)[0] + [encoder.eos[0]] for t in texts]
    assert from_files == expected  # one document per text file


def test_rows_are_cached_once_and_a_changed_file_is_read_again(folders, tmp_path):
    root, corpus, model = folders
    jsonl = tmp_path / "small.jsonl"
    jsonl.write_text(corpus["jsonl"].read_text())
    data = HFTextDataModule(files=str(jsonl), tokenizer=str(model), seq_len=SEQ, val_every=4, cache_dir=str(tmp_path))
    data.setup()
    first = data.row_files()["train"]
    written = first.stat().st_mtime_ns
    again = HFTextDataModule(files=str(jsonl), tokenizer=str(model), seq_len=SEQ, val_every=4, cache_dir=str(tmp_path))
    again.setup()
    assert again.row_files()["train"] == first and first.stat().st_mtime_ns == written
    assert len(data.val_rows) > 0 and len(data.train_rows) > 0
    jsonl.write_text(jsonl.read_text() + json.dumps({"text": "w1 w2 w3 w4"}) + "\n")
    assert again.row_files()["train"] != first


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer=None), "model.pretrained=DIR"),
    (dict(files=[]), "data.files is empty"),
    (dict(files="/no/such/file.jsonl"), "does not exist"),
    (dict(text_field="body", prompt_field="question"), "set data.text_field"),
    (dict(tokenizer="/tmp"), "holds no tokenizer.json"),
    (dict(vocab_size=10), "use the model folder's own tokenizer"),
])
def test_mistakes_are_refused_with_the_fix(folders, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _data(folders, **{"cache_dir": str(tmp_path), **kwargs})


def test_hf_finetune_composes_with_the_model_folders_tokenizer(folders):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from lightning_parallel.cli.train import CONFIG_DIR

    root, corpus, model = folders
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=hf_finetune", f"model.pretrained={model}",
                                           f"data.files={corpus['jsonl']}", "paths.output_dir=/tmp/lp-hf-finetune"])
    data = instantiate(cfg.data)
    assert data.hparams.tokenizer == str(model) and data.hparams.packing and cfg.model.vocab_size is None


@pytest.mark.parametrize("override, message", [
    ("data.files=null", "data.files is empty"),
    ("data.files=[/no/such/train.jsonl]", "data.files: /no/such/train.jsonl does not exist"),
    ("data.val_files=/no/such/val.jsonl", "data.val_files: /no/such/val.jsonl does not exist"),
])
def test_lp_train_refuses_missing_files_before_any_rank_starts(folders, override, message):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_parallel.cli.preflight import ConfigError, preflight
    from lightning_parallel.cli.train import CONFIG_DIR

    root, corpus, model = folders
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=hf_finetune", f"model.pretrained={model}",
                                           f"data.files={corpus['jsonl']}", override,
                                           "paths.output_dir=/tmp/lp-hf-finetune"])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg)


def test_chat_template_wraps_the_prompt_and_still_masks_it(folders, tmp_path):
    import shutil

    import transformers

    _, corpus, model = folders
    chat = tmp_path / "chat_model"
    shutil.copytree(model, chat)
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat)
    tokenizer.chat_template = ("{% for m in messages %}w1 {{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %} w2{% endif %}")
    tokenizer.save_pretrained(chat)
    folder_tokenizer = FolderTokenizer(chat)
    record = {"prompt": "w5 w6", "response": "w7 w8"}
    ids, labels = RecordEncoder(folder_tokenizer, chat_template=True).encode([record])[0]
    head = folder_tokenizer.encode(["w1 w5 w6 w2"], special=True)[0]
    assert ids.tolist()[:len(head)] == head and (labels[:len(head)] == IGNORE_INDEX).all()
    response = folder_tokenizer.encode(["w7 w8"], special=False)[0] + [folder_tokenizer.eos_id]
    assert labels[len(head):].tolist() == response
    with pytest.raises(ValueError, match="has no chat template"):
        RecordEncoder(FolderTokenizer(model), chat_template=True).encode([record])


def test_loader_workers_read_the_same_rows_from_the_memory_map(folders):
    from itertools import islice

    data = _data(folders, num_workers=0)
    plain = list(islice(data.train_dataloader(), 4))
    with_workers = list(islice(_data(folders, num_workers=2).train_dataloader(), 4))
    for a, b in zip(plain, with_workers):
        assert all(torch.equal(a[key], b[key]) for key in a)
