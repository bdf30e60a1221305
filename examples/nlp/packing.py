"""Tokenized documents as fixed-length rows: packed several to a row with their boundaries kept, or one per row.

A row is stored as three int32 channels of ``seq_len``: token ids, labels (``-100``: no loss) and a segment
number (1, 2, ... per document of the row, 0 for padding). The batch a model sees is derived from them when a row
is read (:class:`PackedRows`):

* packed (``packing=True``): ``{input_ids, position_ids, labels}``, the position ids restarting at 0 at every
  document (padding at a row's end is one more document, without loss). No ``attention_mask``: from restarting
  position ids transformers blocks attention across documents in one process, and the suite's context, pipeline,
  tensor and expert paths build the same document mask (``lightning_parallel.parallel.context.masks``);
* packed without document masks (``document_masks=False``): position ids count over the whole row, so a token
  sees the earlier documents of its row -- plain concatenation, as pre-training often does (and the negative
  control of the tests);
* unpacked (``packing=False``): ``{input_ids, attention_mask, labels}``, one document per row, right-padded.

Note:
    Each document's first label is ``-100``: packed, the last token of the document before would otherwise be
    trained to predict it. One process on the same document alone never predicts its first token either, so a
    packed document's token losses equal its unpacked ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

IGNORE_INDEX = -100  # transformers' and torch's ignore_index
CHANNELS = 3  # token ids, labels, segment numbers

Document = tuple[np.ndarray, np.ndarray]  # (token ids, labels) of one document, int32


def pieces(document: Document, seq_len: int) -> Iterator[Document]:
    """A document cut into pieces of at most ``seq_len`` tokens, each its own document (first label ``-100``).

    Args:
        document: token ids and labels of equal length.
        seq_len: tokens per row.
    """
    ids, labels = document
    for start in range(0, len(ids), seq_len):
        piece_labels = labels[start:start + seq_len].copy()
        piece_labels[0] = IGNORE_INDEX
        if (piece_labels != IGNORE_INDEX).any():  # a piece with nothing to learn (all prompt) is left out
            yield ids[start:start + seq_len], piece_labels


class _Row:
    """One row being filled: its channels and how many positions are taken."""

    def __init__(self, seq_len: int, pad_id: int) -> None:
        self.data = np.zeros((CHANNELS, seq_len), dtype=np.int32)
        self.data[0], self.data[1] = pad_id, IGNORE_INDEX
        self.used = self.documents = 0

    def free(self) -> int:
        return self.data.shape[1] - self.used

    def add(self, document: Document) -> None:
        ids, labels = document
        end = self.used + len(ids)
        self.documents += 1
        self.data[:2, self.used:end] = ids, labels
        self.data[2, self.used:end] = self.documents
        self.used = end


def pack_rows(documents: Iterable[Document], seq_len: int, pad_id: int, packing: bool = True,
              open_rows: int = 64) -> Iterator[np.ndarray]:
    """Rows ``[3, seq_len]`` of ``documents``: first fit into the ``open_rows`` rows being filled, or one per row.

    Deterministic (the same documents give the same rows in every process). A document longer than ``seq_len``
    is cut (:func:`pieces`). A full row is emitted at once; when a piece fits no open row and ``open_rows`` are
    open, the oldest is emitted with its tail padded.

    Args:
        documents: (token ids, labels) per document, in corpus order.
        seq_len: tokens per row.
        pad_id: token id of padding (never attended by a document, never a target).
        packing: False: every piece gets its own row.
        open_rows: rows filled at once (more: fewer padding tokens; the order of documents moves further).
    """
    if open_rows < 1:
        raise ValueError(f"open_rows={open_rows} must be at least 1.")
    rows: list[_Row] = []
    for document in documents:
        for piece in pieces(document, seq_len):
            target = next((row for row in rows if row.free() >= len(piece[0])), None) if packing else None
            if target is None:
                if rows and (len(rows) >= open_rows or not packing):
                    yield rows.pop(0).data
                target = _Row(seq_len, pad_id)
                rows.append(target)
            target.add(piece)
            if target.free() == 0:
                rows.remove(target)
                yield target.data
    for row in rows:
        yield row.data


def write_rows(rows: Iterable[np.ndarray], path: Path, seq_len: int) -> dict:
    """Write rows to ``path`` (raw int32, made visible only once complete) and its summary beside it (``.json``).

    Rows stream to disk, so a corpus larger than memory packs in the memory of ``open_rows`` rows.

    Returns:
        The summary: ``rows``, ``seq_len``, ``tokens`` (document tokens), ``targets`` (tokens with a loss).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    count = tokens = targets = 0
    with open(partial, "wb") as handle:
        for row in rows:
            handle.write(np.ascontiguousarray(row, dtype=np.int32).tobytes())
            count, tokens, targets = count + 1, tokens + int((row[2] > 0).sum()), targets + int((row[1] >= 0).sum())
    summary = {"rows": count, "seq_len": seq_len, "tokens": tokens, "targets": targets}
    path.with_suffix(".json").write_text(json.dumps(summary))
    os.replace(partial, path)  # atomic: a reader sees no file or the whole one
    return summary


def position_ids(segments: Tensor, document_masks: bool = True) -> Tensor:
    """Position ids restarting at 0 at every document (segment change), or counting over the row.

    Args:
        segments: ``[..., seq_len]`` segment numbers of rows (0 for padding, which counts as a document too).
        document_masks: False: ``0 .. seq_len - 1`` (documents then see each other).
    """
    arange = torch.arange(segments.shape[-1]).expand_as(segments)
    if not document_masks:
        return arange.clone()
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[..., 1:] = segments[..., 1:] != segments[..., :-1]
    first = torch.where(starts, arange, torch.zeros_like(arange)).cummax(-1).values  # each position's document start
    return arange - first


class PackedRows(Dataset):
    """The rows :func:`write_rows` wrote, read from a memory map: a process touches only the rows it reads.

    Args:
        path: the rows file.
        packing: whether rows hold several documents (batches with ``position_ids``) or one (``attention_mask``).
        document_masks: packed rows only: False gives position ids over the whole row (see the module's doc).
    """

    def __init__(self, path: str | Path, packing: bool = True, document_masks: bool = True) -> None:
        self.path, self.packing, self.document_masks = Path(path), packing, document_masks
        summary = json.loads(self.path.with_suffix(".json").read_text())
        self.rows, self.seq_len = int(summary["rows"]), int(summary["seq_len"])
        self._map: Optional[np.ndarray] = None  # opened on first read: each loader worker opens its own

    def __len__(self) -> int:
        return self.rows

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}

    def row(self, index: int) -> np.ndarray:
        """The stored ``[3, seq_len]`` channels of row ``index``."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.int32, mode="r", shape=(self.rows, CHANNELS, self.seq_len))
        return np.array(self._map[index])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        ids, labels, segments = torch.from_numpy(self.row(index)).long()
        if not self.packing:
            return {"input_ids": ids, "attention_mask": (segments > 0).long(), "labels": labels}
        return {"input_ids": ids, "position_ids": position_ids(segments, self.document_masks), "labels": labels}
