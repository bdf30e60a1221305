"""Criteo-format click logs for the TorchRec DLRM: ``KeyedJaggedTensor`` batches from your TSV files.

The format of the Criteo Kaggle display-advertising set and the Criteo 1TB day files: one impression per line,
tab-separated, ``label``, 13 integer features, 26 categorical features as hex strings, any of them empty when
missing. The file is read in chunks of ``chunk_rows`` lines (parsed a chunk at a time, kept as compact arrays: 13
float32 and 26 int32 per line). Integers become ``log(1 + max(x, 0))``; each categorical value is hashed into
its own table (``int(value, 16) % table_sizes[j]``), and a missing one is an *empty* bag (length 0 in the
``KeyedJaggedTensor``: its pooled embedding is zero), which is what jagged inputs are for. The last
``val_fraction`` of the lines is the validation split (Criteo benchmarks hold out the last day).

The plain ``nn.Embedding`` DLRM reads the same format as dense tensors (``data=clicks data.path=...``,
:func:`examples.recsys.data.read_criteo_tsv`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from .torchrec_data import JaggedClickLog, ZipfClickDataModule

DENSE, SPARSE = 13, 26
MISSING = -1


def read_chunks(path: str | Path, chunk_rows: int = 65536,
                max_rows: Optional[int] = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(labels int64 (n,), dense float32 (n, 13), categories int64 (n, 26), -1 where missing)`` per chunk.

    Args:
        path: a Criteo-format TSV.
        chunk_rows: lines parsed at a time.
        max_rows: stop after this many lines (None: the whole file).

    Raises:
        ValueError: a line without 40 fields, or a value that is not an integer / hex string (its line named).
    """
    width = 1 + DENSE + SPARSE
    read = 0
    with open(Path(path).expanduser()) as handle:
        while max_rows is None or read < max_rows:
            wanted = chunk_rows if max_rows is None else min(chunk_rows, max_rows - read)
            lines = [line for _, line in zip(range(wanted), handle)]
            if not lines:
                return
            fields = [line.rstrip("\n").split("\t") for line in lines]
            for offset, row in enumerate(fields):
                if len(row) != width:
                    raise ValueError(f"{path}:{read + offset + 1} has {len(row)} tab-separated fields; a Criteo line "
                                     f"has {width} (label, {DENSE} integers, {SPARSE} hex categories).")
            try:
                labels = np.array([int(row[0]) for row in fields], dtype=np.int64)
                dense = np.array([[float(v) if v else 0.0 for v in row[1:1 + DENSE]] for row in fields])
                sparse = np.array([[int(v, 16) if v else MISSING for v in row[1 + DENSE:]] for row in fields])
            except ValueError as error:
                raise ValueError(f"{path}, lines {read + 1}-{read + len(fields)}: {error} (a Criteo line holds a 0/1 "
                                 "label, integers and hex strings).") from error
            read += len(fields)
            yield labels, np.log1p(np.maximum(dense, 0.0)).astype(np.float32), sparse


def read_criteo_log(path: str | Path, table_sizes: Sequence[int], chunk_rows: int = 65536,
                    max_rows: Optional[int] = None) -> JaggedClickLog:
    """A Criteo-format TSV as a :class:`JaggedClickLog`, each category hashed into its table, missing ones empty.

    Args:
        path: the TSV.
        table_sizes: rows of each of the 26 categorical features' tables (the model's ``table_sizes``).
        chunk_rows: lines parsed at a time.
        max_rows: read at most this many lines.

    Raises:
        ValueError: not 26 tables, no file, or an empty one.
    """
    if len(table_sizes) != SPARSE:
        raise ValueError(f"A Criteo line has {SPARSE} categorical features; model.table_sizes has {len(table_sizes)} "
                         f"tables: give {SPARSE} sizes (experiment=recsys_criteo does).")
    if not Path(path).expanduser().is_file():
        raise ValueError(f"data.path={str(path)!r} is not a file: point it at a Criteo-format TSV.")
    sizes = np.asarray(table_sizes, dtype=np.int64)
    labels, dense, lengths, values = [], [], [[] for _ in sizes], [[] for _ in sizes]
    for chunk_labels, chunk_dense, sparse in read_chunks(path, chunk_rows, max_rows):
        labels.append(chunk_labels)
        dense.append(chunk_dense)
        for j, rows in enumerate(sizes):
            present = sparse[:, j] != MISSING
            lengths[j].append(present.astype(np.int64))
            values[j].append((sparse[present, j] % rows).astype(np.int32))
    if not labels:
        raise ValueError(f"{path} holds no lines: point data.path at a non-empty Criteo-format TSV.")
    offsets = [np.concatenate([[0], np.cumsum(np.concatenate(parts))]).astype(np.int64) for parts in lengths]
    return JaggedClickLog(np.concatenate(dense), offsets, [np.concatenate(v).astype(np.int64) for v in values],
                          np.concatenate(labels))


class CriteoClickDataModule(ZipfClickDataModule):
    """A Criteo-format TSV as ``(dense, KeyedJaggedTensor, label)`` batches for the TorchRec DLRM.

    Args:
        path: the TSV file (required).
        table_sizes: rows of each of the 26 tables (the model's ``table_sizes``).
        val_fraction: the file's last lines held out for validation.
        max_rows: read at most this many lines (None: all).
        chunk_rows: lines parsed at a time.
        batch_size: samples per data-parallel rank per step.
        shuffle: reshuffle the training lines every epoch.
    """

    def __init__(self, path: Optional[str] = None, table_sizes: Sequence[int] = (65536,) * SPARSE,
                 val_fraction: float = 0.05, max_rows: Optional[int] = None, chunk_rows: int = 65536,
                 batch_size: int = 512, shuffle: bool = True) -> None:
        if path is None:
            raise ValueError("experiment=recsys_criteo needs your file: data.path=/path/to/train.txt "
                             "(Criteo-format TSV: label, 13 integers, 26 hex categories per line).")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1.")
        super().__init__(table_sizes=table_sizes, num_dense=DENSE, batch_size=batch_size, shuffle=shuffle)
        self.path, self.val_fraction, self.max_rows, self.chunk_rows = path, val_fraction, max_rows, chunk_rows

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_log is None:
            log = read_criteo_log(self.path, self.table_sizes, self.chunk_rows, self.max_rows)
            held_out = max(1, int(round(len(log) * self.val_fraction)))
            if held_out >= len(log):
                raise ValueError(f"{self.path} has {len(log)} lines: too few to hold out {held_out} for validation.")
            self.train_log, self.val_log = log.take(0, len(log) - held_out), log.take(len(log) - held_out, len(log))
