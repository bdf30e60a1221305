"""Documents from local files: a tokenizer from a folder, records through Hugging Face ``datasets``, token ids
and labels per record.

Formats (by suffix, or a folder): ``.jsonl`` / ``.json``, ``.parquet``, ``.arrow``, plain text (``.txt``, ``.md``,
anything else: one document per file), and a folder written by ``Dataset.save_to_disk`` (``state.json`` inside;
every split of a ``DatasetDict``). A folder of files is read file by file, sorted. Files are streamed
(``streaming=True``), so a corpus larger than memory is read once, a batch of records at a time; ``datasets`` and
the tokenizer are imported only here (the ``hf`` extra, with ``datasets``).

A record is a document either way:

* ``text`` (``text_field``): every token carries a loss (but the first, see :mod:`.packing`);
* ``prompt`` + ``response`` (``prompt_field``, ``response_field``): prompt tokens carry no loss (``-100``), as
  supervised fine-tuning does; with ``chat_template=True`` the prompt goes through the tokenizer's chat template
  as a user turn (with the generation prompt) and the response follows it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .packing import IGNORE_INDEX, Document

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
RECORDS_PER_BATCH = 256  # records tokenized together (the tokenizer spreads a batch over its threads)


def _module(name: str, extra: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"data=hf_text needs {name}: pip install -e '.[{extra}]'") from error


class FolderTokenizer:
    """The tokenizer of a local folder (``save_pretrained``'s, or a bare ``tokenizer.json``), nothing downloaded.

    Args:
        folder: a folder with ``tokenizer_config.json`` (read by ``AutoTokenizer``) or ``tokenizer.json`` alone
            (read by ``tokenizers``), or the path of a ``tokenizer.json``.
        eos_token: the end-of-document token when the folder names none (a bare ``tokenizer.json``).
    """

    def __init__(self, folder: str | Path, eos_token: Optional[str] = None) -> None:
        path = Path(folder).expanduser()
        self.folder = path if path.is_dir() else path.parent
        if (self.folder / "tokenizer_config.json").is_file() and path.is_dir():
            transformers = _module("transformers", "hf")
            self.auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self.fast = self.auto.backend_tokenizer if getattr(self.auto, "is_fast", False) else None
            eos, pad, self.vocab_size = self.auto.eos_token_id, self.auto.pad_token_id, len(self.auto)
        elif (self.folder / "tokenizer.json").is_file():
            tokenizers = _module("tokenizers", "hf")
            file = path if path.is_file() else path / "tokenizer.json"
            self.auto, self.fast = None, tokenizers.Tokenizer.from_file(str(file))
            eos = self.fast.token_to_id(eos_token) if eos_token else None
            pad, self.vocab_size = None, self.fast.get_vocab_size(with_added_tokens=True)
        else:
            raise ValueError(f"data.tokenizer={str(folder)!r} holds no tokenizer.json or tokenizer_config.json: give "
                             "a folder written by save_pretrained (or by tokenizers' Tokenizer.save).")
        self.eos_id = eos
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)

    def fingerprint(self) -> str:
        """A hash of the folder's tokenizer files (part of the cache key: another tokenizer, other tokens)."""
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                digest.update(name.encode() + (self.folder / name).read_bytes())
        return digest.hexdigest()[:16]

    def encode(self, texts: Sequence[str], special: bool) -> list[list[int]]:
        """Token ids of each text; ``special``: with the tokenizer's own added tokens (a BOS, ...)."""
        if self.fast is not None:
            return [e.ids for e in self.fast.encode_batch(list(texts), add_special_tokens=special)]
        return self.auto(list(texts), add_special_tokens=special)["input_ids"]

    def chat_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt as a user turn through the tokenizer's chat template, ending with the generation prompt."""
        if self.auto is None or not getattr(self.auto, "chat_template", None):
            raise ValueError(f"data.chat_template=true, but the tokenizer in {str(self.folder)!r} has no chat "
                             "template: set data.chat_template=false.")
        return [list(self.auto.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)) for p in prompts]


def expand_files(files: str | Sequence[str]) -> list[Path]:
    """Files and ``save_to_disk`` folders named by ``files`` (a folder of files: its files, sorted).

    Raises:
        ValueError: nothing given, or a path that does not exist.
    """
    names = [files] if isinstance(files, (str, Path)) else list(files or [])
    if not names:
        raise ValueError("data.files is empty: give a file or folder, e.g. data.files=/path/train.jsonl "
                         "or data.files=[a.jsonl,b.parquet].")
    found: list[Path] = []
    for name in names:
        path = Path(str(name)).expanduser()
        if not path.exists():
            raise ValueError(f"data.files: {str(path)!r} does not exist.")
        if path.is_dir() and not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
            found.extend(p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith("."))
        else:
            found.append(path)
    return found


def fingerprint_files(paths: Iterable[Path]) -> str:
    """A hash of the paths, sizes and modification times of the files (a folder: of its files)."""
    digest = hashlib.sha256()
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            stat = file.stat()
            digest.update(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _from_disk(path: Path) -> Iterator[dict]:
    datasets = _module("datasets", "hf")
    loaded = datasets.load_from_disk(str(path))
    splits = [loaded[name] for name in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    for split in splits:
        yield from split


def read_records(paths: Sequence[Path], cache_dir: Optional[Path] = None) -> Iterator[dict]:
    """The records of every file, in order, streamed through ``datasets`` (plain text: a record per file)."""
    datasets = _module("datasets", "hf")
    for path in paths:
        if path.is_dir():
            yield from _from_disk(path)
            continue
        builder = BUILDERS.get(path.suffix.lower(), "text")
        options = {"sample_by": "document"} if builder == "text" else {}
        yield from datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True,
                                         cache_dir=None if cache_dir is None else str(cache_dir), **options)


def _batches(records: Iterable[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class RecordEncoder:
    """Records to (token ids, labels) documents: ``text``, or ``prompt`` + ``response`` with the prompt masked.

    Args:
        tokenizer: the :class:`FolderTokenizer`.
        text_field: the key of a plain document's text.
        prompt_field: the key of a prompt (its tokens carry no loss).
        response_field: the key of the response to a prompt.
        chat_template: prompts through the tokenizer's chat template.
        add_eos: end each document with the tokenizer's end-of-sequence token (when it has one).
    """

    def __init__(self, tokenizer: FolderTokenizer, text_field: str = "text", prompt_field: str = "prompt",
                 response_field: str = "response", chat_template: bool = False, add_eos: bool = True) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.fields = (text_field, prompt_field, response_field)
        self.eos = [tokenizer.eos_id] if add_eos and tokenizer.eos_id is not None else []

    def _kind(self, record: dict) -> str:
        text, prompt, response = self.fields
        if record.get(prompt) is not None and record.get(response) is not None:
            return "pair"
        if record.get(text) is not None:
            return "text"
        raise ValueError(f"A record has neither {text!r} nor {prompt!r} + {response!r} (its keys: {sorted(record)}): "
                         "set data.text_field, or data.prompt_field and data.response_field, to your field names.")

    def encode(self, records: Sequence[dict]) -> list[Document]:
        """The documents of a batch of records, in order."""
        text, prompt, response = self.fields
        kinds = [self._kind(r) for r in records]
        pairs = [r for r, k in zip(records, kinds) if k == "pair"]
        texts = iter(self.tokenizer.encode([r[text] for r, k in zip(records, kinds) if k == "text"], special=True))
        prompts = [r[prompt] for r in pairs]
        asked = iter(self.tokenizer.chat_prompts(prompts) if self.chat_template
                     else self.tokenizer.encode(prompts, special=True))
        answers = iter(self.tokenizer.encode([r[response] for r in pairs], special=False))
        documents = []
        for kind in kinds:
            head = [] if kind == "text" else next(asked)
            body = (next(texts) if kind == "text" else next(answers)) + self.eos
            ids = np.asarray(head + body, dtype=np.int32)
            labels = ids.copy()
            labels[:len(head)] = IGNORE_INDEX
            documents.append((ids, labels))
        return documents

    def documents(self, records: Iterable[dict]) -> Iterator[Document]:
        """Every record's document, in order (tokenized a batch at a time)."""
        for batch in _batches(records, RECORDS_PER_BATCH):
            yield from self.encode(batch)


def settings_key(**settings: Any) -> str:
    """A short hash of the settings that decide the rows (the cache file's name)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:20]
