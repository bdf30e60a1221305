"""Your own text for Hugging Face causal LMs: a folder's tokenizer, local files, packed rows (``data=hf_text``).

``prepare_data`` (once per node, before any rank reads) tokenizes the files and writes the training and
validation rows to ``cache_dir`` under a name hashed from everything that decides them (files' paths, sizes and
times, the tokenizer's files, the settings); a later run with the same inputs reads them again. ``setup``
memory-maps them: each data-parallel rank reads only the rows its shard holds. The training loader is the
suite's :func:`~lightning_parallel.resumable_loader.resumable_loader`, so its position is a place in the global
row stream and a checkpoint resumes exactly, also at another data-parallel size. Batches and their masks:
:mod:`.packing`; records and tokenizers: :mod:`.text_files`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Subset

from lightning_parallel.resumable_loader import resumable_loader

from .packing import PackedRows, pack_rows, write_rows
from .text_files import FolderTokenizer, RecordEncoder, expand_files, fingerprint_files, read_records, settings_key

log = logging.getLogger(__name__)
DEFAULT_CACHE = Path("~/.cache/lightning_parallel/hf_text")


class HFTextDataModule(pl.LightningDataModule):
    """Local text files as packed (or padded) rows of a folder's tokens, with a held-out validation split.

    Args:
        files: a file, a folder, or a list of them (:func:`~.text_files.expand_files`).
        tokenizer: a folder with the tokenizer (``model.pretrained``'s by default in the configs).
        val_files: the validation split's files; None holds out every ``val_every``-th document of ``files``.
        seq_len: tokens per row.
        batch_size: rows per data-parallel rank per step.
        packing: several documents per row (position ids restart per document); False: one per row, padded.
        document_masks: packed rows keep their documents apart; False lets them see each other (concatenation).
        text_field: the key of a plain document's text.
        prompt_field: the key of a prompt (no loss on its tokens).
        response_field: the key of a prompt's response.
        chat_template: prompts through the tokenizer's chat template.
        add_eos: end every document with the tokenizer's end-of-sequence token.
        eos_token: the end-of-sequence token of a bare ``tokenizer.json`` (a folder's config names its own).
        val_every: with ``val_files`` None, every n-th document is held out (0: no validation split).
        max_val_batches: validation global batches read at most.
        open_rows: rows filled at once when packing (:func:`~.packing.pack_rows`).
        cache_dir: where the rows are written; default ``~/.cache/lightning_parallel/hf_text``.
        num_workers: loader workers (each opens the memory map itself).
        vocab_size: the model's vocabulary; token ids at or above it are refused. None: not checked.
    """

    def __init__(
        self, files: str | Sequence[str], tokenizer: Optional[str] = None, val_files: Optional[Any] = None,
        seq_len: int = 256, batch_size: int = 8, packing: bool = True, document_masks: bool = True,
        text_field: str = "text", prompt_field: str = "prompt", response_field: str = "response",
        chat_template: bool = False, add_eos: bool = True, eos_token: Optional[str] = None, val_every: int = 20,
        max_val_batches: int = 16, open_rows: int = 64, cache_dir: Optional[str] = None, num_workers: int = 0,
        vocab_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError("data=hf_text needs a tokenizer: set model.pretrained=DIR (its tokenizer is used) or "
                             "data.tokenizer=DIR (a folder with tokenizer.json).")
        if seq_len < 2 or batch_size < 1 or val_every < 0:
            raise ValueError(f"data.seq_len={seq_len} must be >= 2, data.batch_size={batch_size} >= 1 and "
                             f"data.val_every={val_every} >= 0.")
        self.save_hyperparameters()
        self.paths = expand_files(files)  # missing files are refused here, before any rank starts
        self.val_paths = expand_files(val_files) if val_files else None
        self.train_rows: Optional[PackedRows] = None
        self.val_rows: Optional[PackedRows] = None

    def _tokenizer(self) -> FolderTokenizer:
        return FolderTokenizer(self.hparams.tokenizer, self.hparams.eos_token)

    def row_files(self, tokenizer: Optional[FolderTokenizer] = None) -> dict[str, Path]:
        """The rows files of the splits (``train``, ``val``) for these inputs and settings."""
        h = self.hparams
        tokenizer = tokenizer or self._tokenizer()
        key = settings_key(
            files=fingerprint_files(self.paths), val=fingerprint_files(self.val_paths or []),
            tokenizer=tokenizer.fingerprint(),
            fields=[h.text_field, h.prompt_field, h.response_field], chat=h.chat_template, eos=h.add_eos,
            eos_token=h.eos_token, seq_len=h.seq_len, packing=h.packing, val_every=h.val_every, open_rows=h.open_rows,
            version=1,
        )
        folder = Path(h.cache_dir or DEFAULT_CACHE).expanduser() / key
        return {"train": folder / "train.rows", "val": folder / "val.rows"}

    def _split(self, encoder: RecordEncoder, held_out: bool) -> Iterator:
        """The documents of one split (validation: ``val_files``, or every ``val_every``-th document)."""
        every = self.hparams.val_every
        if self.val_paths is not None:
            yield from encoder.documents(read_records(self.val_paths if held_out else self.paths))
            return
        for index, document in enumerate(encoder.documents(read_records(self.paths))):
            if every and (index % every == every - 1) == held_out:
                yield document
            elif not every and not held_out:
                yield document

    def prepare_data(self) -> None:
        """Tokenize and pack the splits once (Lightning calls this on one process per node, then the rest wait)."""
        h, tokenizer = self.hparams, self._tokenizer()
        encoder = RecordEncoder(tokenizer, h.text_field, h.prompt_field, h.response_field, h.chat_template, h.add_eos)
        for split, path in self.row_files(tokenizer).items():
            if path.is_file():
                continue
            rows = pack_rows(self._split(encoder, split == "val"), h.seq_len, tokenizer.pad_id, h.packing, h.open_rows)
            summary = write_rows(rows, path, h.seq_len)
            fill = summary["tokens"] / max(1, summary["rows"] * h.seq_len)
            log.info("hf_text %s: %d rows of %d tokens, %.1f%% document tokens, %d with a loss (%s)", split,
                     summary["rows"], h.seq_len, 100 * fill, summary["targets"], path)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_rows is not None:
            return
        tokenizer = self._tokenizer()
        files = self.row_files(tokenizer)
        if not all(path.is_file() for path in files.values()):
            self.prepare_data()  # used without a Trainer, or prepare_data_per_node=False on a shared disk
        h = self.hparams
        self.train_rows = PackedRows(files["train"], h.packing, h.document_masks)
        self.val_rows = PackedRows(files["val"], h.packing, h.document_masks)
        self._check(tokenizer)

    def _check(self, tokenizer: FolderTokenizer) -> None:
        vocab = self.hparams.vocab_size
        model_config = getattr(getattr(self, "trainer", None) and self.trainer.lightning_module, "model_config", None)
        vocab = getattr(model_config, "vocab_size", None) or vocab
        if vocab is not None and tokenizer.vocab_size > vocab:
            raise ValueError(f"The tokenizer in {self.hparams.tokenizer!r} has {tokenizer.vocab_size} tokens, the "
                             f"model {vocab}: use the model folder's own tokenizer (data.tokenizer=null with "
                             "model.pretrained).")
        if len(self.train_rows) == 0:
            raise ValueError(f"data.files {[str(p) for p in self.paths]} gave no training rows: they hold no records "
                             "with text (or every document was held out: raise data.val_every).")

    def train_dataloader(self) -> DataLoader:
        # Sharded over data-parallel ranks, its position a place in the global row stream (exact resume anywhere).
        return resumable_loader(self.train_rows, batch_size=self.hparams.batch_size, trainer=self.trainer,
                                num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        # Global batches of batch_size x data-parallel size, each rank reading its share (the same rows as one
        # process's batches of that size): the suite's strategies weigh each batch's loss by token over the
        # data-parallel ranks, so val_loss is the same number at every layout.
        shard = getattr(getattr(self.trainer, "strategy", None), "distributed_sampler_kwargs", None) or {}
        global_batch = self.hparams.batch_size * int(shard.get("num_replicas", 1))
        count = min(len(self.val_rows), self.hparams.max_val_batches * global_batch) // global_batch * global_batch
        if count == 0:
            log.warning("hf_text: the validation split has %d rows, fewer than a global batch of %d: no validation "
                        "(lower data.val_every or give data.val_files).", len(self.val_rows), global_batch)
            return []
        return resumable_loader(Subset(self.val_rows, range(count)), batch_size=self.hparams.batch_size,
                                trainer=self.trainer, shuffle=False, num_workers=self.hparams.num_workers)

    def batches(self, count: int, split: str = "train") -> list[dict]:
        """The first ``count`` batches of a split in stored order (no shuffle, one process): for checks and tests."""
        self.setup()
        rows = self.train_rows if split == "train" else self.val_rows
        loader = DataLoader(rows, batch_size=self.hparams.batch_size)
        return list(itertools.islice(loader, count))
