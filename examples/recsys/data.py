"""Click logs for the DLRM recipe: a seeded synthetic log with a known answer, or a Criteo TSV.

The synthetic log (default) plants the structure a recommender should find:

* every user belongs to a segment and every item to a category; segments and categories
  have latent factors (``P[s]``, ``Q[c]``, rank ``latent_rank``), and every user and item
  has its own bias; each impression also has context categories (e.g. hour) with their own
  effects, and ``num_dense`` dense features with linear weights;
* the click probability is ``sigmoid(b + <P[seg(u)], Q[cat(i)]> + b_u + b_i + context
  effects + w . dense)`` and the label is one draw from it.

Because the true probability of every impression is known, the generator also gives the
*Bayes AUC*: the AUC of the true probabilities on the test labels, the best any model can
reach on that test set. The categorical features are ``[user, item, segment, category,
context...]`` with cardinalities ``table_sizes``; with thousands of users and items the
embedding tables are most of the model's memory, as in production recommenders.

``path=`` reads a Criteo-format TSV instead (``label``, 13 integer features, 26 hex
categorical features per line, missing values empty): integers become ``log(1 + max(x, 0))``
and each categorical value is hashed into ``criteo_buckets`` rows of its own table.
Batches are ``(dense float32 (B, D), sparse int64 (B, S), label int64 (B,))``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.resumable_loader import resumable_loader

CRITEO_DENSE = 13
CRITEO_SPARSE = 26


def dense_features(path: str | None, num_dense: int) -> int:
    """Dense features per sample: ``num_dense`` for the synthetic log, 13 for a Criteo TSV.

    Used by the model config (``model.num_dense``) so model and data always agree.
    """
    return CRITEO_DENSE if path else int(num_dense)


def feature_table_sizes(path: str | None, sizes: Sequence[int], criteo_buckets: int) -> list[int]:
    """Embedding rows per categorical feature: ``sizes`` for the synthetic log, 26 tables of
    ``criteo_buckets`` rows for a Criteo TSV. Used by the model config (``model.table_sizes``)."""
    return [int(criteo_buckets)] * CRITEO_SPARSE if path else [int(s) for s in sizes]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve: the chance a random positive scores above a random negative
    (ties count one half), by the Mann-Whitney rank sum.

    Args:
        scores: one score per sample (any monotone scale: probabilities or logits).
        labels: 0/1 per sample; both classes must occur.
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs both clicks and non-clicks among the labels: use a larger evaluation set.")
    # Average 1-based rank within every group of tied scores.
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + ends + 1) / 2.0)[inverse]
    return float((ranks[labels].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


@dataclass
class ClickLog:
    """One split of a click log.

    Attributes:
        dense: ``(N, D)`` float32 dense features.
        sparse: ``(N, S)`` int64 categorical ids, column ``j`` in ``[0, table_sizes[j])``.
        labels: ``(N,)`` int64 clicks (0/1).
        probability: ``(N,)`` true click probability (synthetic logs only, else None).
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    probability: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def dataset(self) -> TensorDataset:
        return TensorDataset(torch.from_numpy(self.dense), torch.from_numpy(self.sparse), torch.from_numpy(self.labels))


def synthetic_click_log(
    samples: Sequence[int],
    table_sizes: Sequence[int],
    num_dense: int,
    latent_rank: int = 4,
    interaction_scale: float = 1.5,
    entity_scale: float = 0.4,
    bias: float = -1.0,
    seed: int = 0,
) -> list[ClickLog]:
    """Generate click-log splits from one planted model.

    The categorical features are ``[user, item, user segment, item category, context...]``
    with cardinalities ``table_sizes``. Every user belongs to one segment and every item to
    one category (drawn once); segments and categories carry the latent factors, so the
    user-item affinity is ``<P[segment(u)], Q[category(i)]>``, as when tastes are shared by
    groups. Users and items add their own bias (``entity_scale``): the large id tables hold
    a real but small signal, which is what makes them hard to learn from few impressions.

    Args:
        samples: impressions per split, e.g. ``(train, val, test)``.
        table_sizes: ``[users, items, segments, categories, context_1, ...]``.
        num_dense: dense features per impression.
        latent_rank: rank of the segment/category factors.
        interaction_scale: standard deviation of the affinity term in logits.
        entity_scale: standard deviation of each user's and item's own bias.
        bias: global logit offset (sets the click rate).
        seed: everything is drawn from this seed: the same arguments give the same log.

    Returns:
        One :class:`ClickLog` per entry of ``samples``, with the true ``probability``.
    """
    if len(table_sizes) < 4 or min(table_sizes) < 1:
        raise ValueError(
            f"table_sizes={list(table_sizes)} must list users, items, user segments and item categories "
            "(then any context features), each >= 1 rows."
        )
    rng = np.random.default_rng(seed)
    users, items, segments, categories, *contexts = (int(s) for s in table_sizes)
    segment_of, category_of = rng.integers(0, segments, users), rng.integers(0, categories, items)
    # Scale the factors so <P[s], Q[c]> has standard deviation interaction_scale.
    factor_std = (interaction_scale / np.sqrt(latent_rank)) ** 0.5
    p, q = rng.normal(0.0, factor_std, (segments, latent_rank)), rng.normal(0.0, factor_std, (categories, latent_rank))
    user_bias, item_bias = rng.normal(0.0, entity_scale, users), rng.normal(0.0, entity_scale, items)
    context_effects = [rng.normal(0.0, 0.4, size) for size in contexts]
    weights = rng.normal(0.0, 0.5, num_dense)
    logs = []
    for n in samples:
        user, item = rng.integers(0, users, n), rng.integers(0, items, n)
        segment, category = segment_of[user], category_of[item]
        context = [rng.integers(0, size, n) for size in contexts]
        dense = rng.normal(0.0, 1.0, (n, num_dense)).astype(np.float32)
        logit = bias + np.einsum("nk,nk->n", p[segment], q[category]) + user_bias[user] + item_bias[item]
        for ids, effect in zip(context, context_effects):
            logit += effect[ids]
        logit += dense @ weights
        probability = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < probability).astype(np.int64)
        sparse = np.stack([user, item, segment, category, *context], axis=1).astype(np.int64)
        logs.append(ClickLog(dense, sparse, labels, probability))
    return logs


def read_criteo_tsv(path: str, buckets: int, max_rows: int | None = None) -> ClickLog:
    """Read a Criteo-format TSV: ``label``, 13 integers, 26 hex categories per line (tab-separated).

    Args:
        path: the TSV file.
        buckets: rows of each categorical feature's table; hex values are hashed into them
            (``int(value, 16) % (buckets - 1) + 1``; row 0 is "missing").
        max_rows: read at most this many lines (None: all).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"data.path={path!r} is not a file: point it at a Criteo-format TSV (or null for synthetic data)."
        )
    if buckets < 2:
        raise ValueError(f"criteo_buckets={buckets} must be >= 2 (row 0 is kept for missing values).")
    labels, dense, sparse = [], [], []
    width = 1 + CRITEO_DENSE + CRITEO_SPARSE
    with file.open() as handle:
        for number, line in enumerate(handle, start=1):
            if max_rows is not None and len(labels) >= max_rows:
                break
            fields = line.rstrip("\n").split("\t")
            if len(fields) != width:
                raise ValueError(
                    f"{path}:{number} has {len(fields)} tab-separated fields, a Criteo line has {width} "
                    f"(label, {CRITEO_DENSE} integers, {CRITEO_SPARSE} hex categories)."
                )
            labels.append(int(fields[0]))
            dense.append([float(v) if v else 0.0 for v in fields[1 : 1 + CRITEO_DENSE]])
            sparse.append([int(v, 16) % (buckets - 1) + 1 if v else 0 for v in fields[1 + CRITEO_DENSE :]])
    if not labels:
        raise ValueError(f"{path} holds no lines: point data.path at a non-empty Criteo-format TSV.")
    dense_array = np.log1p(np.maximum(np.asarray(dense, dtype=np.float64), 0.0)).astype(np.float32)
    return ClickLog(dense_array, np.asarray(sparse, dtype=np.int64), np.asarray(labels, dtype=np.int64))


def split_log(log: ClickLog, val_fraction: float, test_fraction: float) -> list[ClickLog]:
    """Cut a log in file order into train / validation / test (the last lines are the test set,
    as Criteo benchmarks hold out the last day)."""
    n = len(log)
    n_test, n_val = int(n * test_fraction), int(n * val_fraction)
    if n - n_test - n_val < 1 or n_test < 1 or n_val < 1:
        raise ValueError(f"{n} lines are too few for val_fraction={val_fraction}, test_fraction={test_fraction}.")
    cuts = [(0, n - n_val - n_test), (n - n_val - n_test, n - n_test), (n - n_test, n)]
    return [ClickLog(log.dense[a:b], log.sparse[a:b], log.labels[a:b]) for a, b in cuts]


class ClickDataModule(pl.LightningDataModule):
    """Click-through data as ``(dense, sparse, label)`` batches.

    Args:
        path: Criteo-format TSV; ``None`` for the synthetic log.
        num_dense: dense features of the synthetic log (a Criteo TSV has 13).
        table_sizes: cardinalities ``[users, items, segments, categories, context...]`` of the
            synthetic log (a Criteo TSV has 26 tables of ``criteo_buckets`` rows).
        criteo_buckets: rows per categorical table for a Criteo TSV.
        train_samples: synthetic training impressions.
        val_samples: synthetic validation impressions.
        test_samples: synthetic test impressions.
        latent_rank: rank of the planted segment/category factors.
        seed: seed of the synthetic log (not the run's seed: the data must not change between runs).
        val_fraction: share of a Criteo file for validation.
        test_fraction: share of a Criteo file for test (its last lines).
        max_rows: lines of a Criteo file to read (None: all).
        batch_size: samples per device per step; evaluation uses the same size.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        path: str | None = None,
        num_dense: int = 4,
        table_sizes: Sequence[int] = (4096, 2048, 32, 32, 24),
        criteo_buckets: int = 32768,
        train_samples: int = 400_000,
        val_samples: int = 20_000,
        test_samples: int = 50_000,
        latent_rank: int = 4,
        seed: int = 0,
        val_fraction: float = 0.05,
        test_fraction: float = 0.1,
        max_rows: int | None = None,
        batch_size: int = 512,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        # The sizes the model is built with (Criteo: 13 dense, 26 hashed tables), as plain
        # ints: Lightning refuses hparams that the model and the data module both hold
        # with different values or types.
        num_dense = dense_features(path, num_dense)
        table_sizes = feature_table_sizes(path, table_sizes, criteo_buckets)
        self.save_hyperparameters()
        self.logs: dict[str, ClickLog] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.logs is not None:
            return
        hp = self.hparams
        if hp.path is None:
            splits = synthetic_click_log(
                (hp.train_samples, hp.val_samples, hp.test_samples),
                list(hp.table_sizes),
                hp.num_dense,
                latent_rank=hp.latent_rank,
                seed=hp.seed,
            )
        else:
            log = read_criteo_tsv(hp.path, hp.criteo_buckets, hp.max_rows)
            splits = split_log(log, hp.val_fraction, hp.test_fraction)
        self.logs = dict(zip(("train", "val", "test"), splits))

    def reference_metrics(self) -> dict[str, float]:
        """The best achievable test AUC (synthetic data only): the AUC of the true click
        probabilities on the test labels. Reported beside the model's AUC."""
        self.setup()
        test = self.logs["test"]
        if test.probability is None:
            return {}
        return {"test_bayes_auc": auc(test.probability, test.labels), "test_click_rate": float(test.labels.mean())}

    def train_dataloader(self) -> DataLoader:
        self.setup()
        # Lightning checkpoints this loader's position: a mid-epoch resume neither repeats nor skips a sample.
        return resumable_loader(
            self.logs["train"].dataset(),
            batch_size=self.hparams.batch_size,
            trainer=self.trainer,
            num_workers=self.hparams.num_workers,
        )

    def _eval_loader(self, split: str) -> DataLoader:
        self.setup()
        # drop_last keeps one batch shape; the evaluation report reads the whole split.
        return DataLoader(
            self.logs[split].dataset(),
            batch_size=self.hparams.batch_size,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
