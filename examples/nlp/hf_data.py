"""Padded byte-level documents as Hugging Face batches: ``{input_ids, attention_mask, labels}``.

The corpus and its train/validation split are the text recipe's (:mod:`.data`). Each sample is
one "document": a window of the corpus cut to a length drawn between ``min_length`` and
``seq_len``, right-padded to ``seq_len``. Padding has ``attention_mask`` 0 and label ``-100``,
so the number of tokens that carry a loss differs from sample to sample -- and from micro-batch
to micro-batch and rank to rank, which is what a loss over a global batch must get right.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_parallel.resumable_loader import resumable_loader

from .data import TextDataModule

IGNORE_INDEX = -100  # the label of a position without a loss (transformers' and torch's ignore_index)


class PaddedDocuments(Dataset):
    """Non-overlapping ``seq_len`` windows of a byte corpus, each cut short and right-padded.

    Args:
        data: the corpus as byte values (a 1-D long tensor).
        seq_len: tokens per sample, padding included.
        vocab_size: token ids stay below it: bytes at or above ``vocab_size - 1`` fold into its last id
            (ASCII text is unchanged at 128).
        min_length: the shortest document (tokens before padding), at least 2.
        pad_token_id: the id of padding.
        seed: seed of the document lengths (fixed, so every process builds the same samples).
    """

    def __init__(
        self, data: Tensor, seq_len: int, vocab_size: int = 256, min_length: Optional[int] = None,
        pad_token_id: int = 0, seed: int = 0,
    ) -> None:
        min_length = max(2, seq_len // 4) if min_length is None else min_length
        if not 2 <= min_length <= seq_len:
            raise ValueError(f"min_length={min_length} must be between 2 and seq_len={seq_len}.")
        if not 0 <= pad_token_id < vocab_size:
            raise ValueError(f"pad_token_id={pad_token_id} must be a token id below vocab_size={vocab_size}.")
        count = len(data) // seq_len
        if count == 0:
            raise ValueError(f"The corpus split has {len(data)} bytes, fewer than seq_len = {seq_len}.")
        self.data = data.clamp(max=vocab_size - 1)
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        generator = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(min_length, seq_len + 1, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        input_ids = self.data[index * self.seq_len : (index + 1) * self.seq_len].clone()
        attention_mask = torch.arange(self.seq_len) < self.lengths[index]
        input_ids[~attention_mask] = self.pad_token_id
        # transformers shifts labels inside the model: labels are the inputs, -100 where padded.
        labels = input_ids.masked_fill(~attention_mask, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "labels": labels}


class PaddedTextDataModule(TextDataModule):
    """The text recipe's corpus as padded documents of varying length, for Hugging Face causal LMs.

    Args:
        vocab_size: the model's vocabulary size; None (raw bytes) is 256.
        min_length: the shortest document; default a quarter of ``seq_len``.
        pad_token_id: the id of padding (0: the NUL byte, absent from text).
        **kwargs: :class:`~examples.nlp.data.TextDataModule` arguments (``path``, ``seq_len``,
            ``batch_size``, ``max_bytes``, ``val_every``, ``max_val_batches``, ``num_workers``).
    """

    def __init__(
        self, vocab_size: Optional[int] = 128, min_length: Optional[int] = None, pad_token_id: int = 0, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def documents(self, data: Tensor) -> PaddedDocuments:
        """The padded documents of one corpus split."""
        h = self.hparams
        return PaddedDocuments(data, h.seq_len, h.vocab_size or 256, h.min_length, h.pad_token_id)

    def train_dataloader(self) -> DataLoader:
        # Sharded over data-parallel ranks, resumable mid-epoch (as the text recipe's loader).
        return resumable_loader(
            self.documents(self.train_data), batch_size=self.hparams.batch_size, trainer=self.trainer,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        documents = self.documents(self.val_data)
        subset = Subset(documents, range(min(len(documents), self.hparams.max_val_batches * self.hparams.batch_size)))
        return DataLoader(
            subset, batch_size=self.hparams.batch_size, drop_last=True, num_workers=self.hparams.num_workers
        )
