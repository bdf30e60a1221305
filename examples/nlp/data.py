"""Byte-level text data that exists on every machine: the Python standard library's source.

No download: by default the corpus is the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (real, varied English-and-code text), read in sorted
order up to ``max_bytes``. ``path=`` points it at any text file or folder instead.
Tokens are raw bytes (vocabulary 256), so there is no tokenizer to ship.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_parallel.resumable_loader import resumable_loader

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".csv", ".html", ".c", ".h", ".yaml", ".toml"}


def _corpus_files(path: str | None) -> list[Path]:
    root = Path(path).expanduser() if path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise ValueError(f"data.path={str(root)!r} does not exist: point it at a text file or a folder of text files.")
    if root.is_file():
        return [root]
    suffixes = {".py"} if path is None else TEXT_SUFFIXES
    # site-packages is excluded so the default corpus is the same whatever is installed. It is pruned from the walk,
    # not filtered after it: the standard library folder holds ~60,000 entries, most of them installed packages,
    # and walking them cost every rank of every run 1.5-5 s.
    files = []
    for folder, subfolders, names in os.walk(root, followlinks=True):  # as rglob, which follows links
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "__pycache__")]
        files += [Path(folder, n) for n in names if Path(n).suffix in suffixes and Path(folder, n).is_file()]
    files.sort()
    if not files:
        raise ValueError(
            f"No text files ({', '.join(sorted(suffixes))}) under {root}: point data.path at a text corpus."
        )
    return files


def _read_parts(path: str | None, max_bytes: int, val_every: int) -> tuple[list[bytes], list[bytes]]:
    """The corpus files as bytes: (training files, held-out files), every ``val_every``-th file held out."""
    train, held, total = [], [], 0
    for i, file in enumerate(_corpus_files(path)):
        data = file.read_bytes()
        (held if i % val_every == val_every - 1 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not held:  # a single file: cut it instead
        joined = b"".join(train)
        cut = int(len(joined) * (1 - 1 / val_every))
        train, held = [joined[:cut]], [joined[cut:]]
    return train, held


def _as_tensor(parts: list[bytes]) -> Tensor:
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()


def load_corpus(path: str | None, max_bytes: int, val_every: int) -> tuple[Tensor, Tensor]:
    """Read the corpus as bytes and split it by file: every ``val_every``-th file is validation.

    Splitting by whole files (not by a cut of one long string) keeps the two splits from the
    same distribution while never sharing a file.

    Args:
        path: text file or folder; ``None`` for the standard library.
        max_bytes: stop reading once this many bytes are collected.
        val_every: every n-th file (in sorted order) goes to the validation split.
    """
    train, held = _read_parts(path, max_bytes, val_every)
    return _as_tensor(train), _as_tensor(held)


def load_splits(path: str | None, max_bytes: int, val_every: int) -> tuple[Tensor, Tensor, Tensor]:
    """Train, validation and test splits: the held-out files of :func:`load_corpus`, alternately
    validation and test (one held-out file is cut in half), so the test split is data the run never
    validated on. The training split is :func:`load_corpus`'s.

    Args:
        path: text file or folder; ``None`` for the standard library.
        max_bytes: stop reading once this many bytes are collected.
        val_every: every n-th file (in sorted order) is held out.
    """
    train, held = _read_parts(path, max_bytes, val_every)
    if len(held) >= 2:
        val, test = held[0::2], held[1::2]
    else:
        joined = b"".join(held)
        val, test = [joined[: len(joined) // 2]], [joined[len(joined) // 2 :]]
    return _as_tensor(train), _as_tensor(val), _as_tensor(test)


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes as ``(inputs, next-byte targets)``."""

    def __init__(self, data: Tensor, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"The corpus split has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}.")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level language-modelling data.

    Args:
        path: text file or folder; ``None`` reads the Python standard library's source.
        seq_len: tokens per sample.
        batch_size: samples per device per step (the micro-batch of one data-parallel rank).
        max_bytes: how much of the corpus to read.
        val_every: every n-th file is held out; held-out files are alternately validation and test.
        max_val_batches: cap on validation samples, as batches (keeps evaluation quick).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_every: int = 10,
        max_val_batches: int = 16,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None
        self.test_data: Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is None:
            splits = load_splits(self.hparams.path, self.hparams.max_bytes, self.hparams.val_every)
            self.train_data, self.val_data, self.test_data = splits

    def unigram_baseline(self) -> float:
        """Cross-entropy (nats/byte) of the validation split under the training split's byte frequencies:
        the loss of a model that ignores context. A language model must beat it."""
        self.setup()
        counts = torch.bincount(self.train_data, minlength=256).double() + 1.0  # add-one: unseen bytes
        log_p = (counts / counts.sum()).log()
        return float(-log_p[self.val_data].mean())

    def train_dataloader(self) -> DataLoader:
        # Lightning checkpoints this loader's position: a mid-epoch resume neither repeats nor skips a sample.
        return resumable_loader(
            ByteWindows(self.train_data, self.hparams.seq_len),
            batch_size=self.hparams.batch_size,
            trainer=self.trainer,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        windows = ByteWindows(self.val_data, self.hparams.seq_len)
        limit = min(len(windows), self.hparams.max_val_batches * self.hparams.batch_size)
        subset = torch.utils.data.Subset(windows, range(limit))
        return DataLoader(
            subset, batch_size=self.hparams.batch_size, drop_last=True, num_workers=self.hparams.num_workers
        )

    def test_dataloader(self) -> DataLoader:
        # The test split through this class's own val_dataloader, so that a subclass that changes the
        # sample format there (hf_data's padded documents) gets the same format for the test split.
        self.setup()
        validation, self.val_data = self.val_data, self.test_data
        try:
            return self.val_dataloader()
        finally:
            self.val_data = validation


def perplexity(loss_nats: float) -> float:
    """Perplexity from a mean cross-entropy in nats."""
    return math.exp(loss_nats)
