"""The recommendation recipe: deterministic synthetic log, Bayes AUC, Criteo reading, model shapes."""

import numpy as np
import pytest
import torch

from examples.recsys.data import ClickDataModule, auc, feature_table_sizes, read_criteo_tsv, synthetic_click_log
from examples.recsys.model import DLRM
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.tensor.plan import concrete_plan

TABLES = (64, 32, 8, 8, 8)


def test_generator_is_deterministic_and_respects_table_sizes():
    a = synthetic_click_log([500, 200], TABLES, num_dense=3, seed=7)
    b = synthetic_click_log([500, 200], TABLES, num_dense=3, seed=7)
    c = synthetic_click_log([500, 200], TABLES, num_dense=3, seed=8)
    for x, y in zip(a, b):
        assert np.array_equal(x.sparse, y.sparse) and np.array_equal(x.labels, y.labels)
        assert np.array_equal(x.dense, y.dense)
    assert not np.array_equal(a[0].labels, c[0].labels)
    log = a[0]
    assert log.dense.shape == (500, 3) and log.sparse.shape == (500, 5) and log.dense.dtype == np.float32
    assert (log.sparse >= 0).all() and (log.sparse < np.array(TABLES)).all()
    assert ((log.probability > 0) & (log.probability < 1)).all() and set(np.unique(log.labels)) <= {0, 1}


def test_users_keep_one_segment_and_items_one_category():
    (log,) = synthetic_click_log([5000], TABLES, num_dense=2, seed=0)
    for entity, group in ((0, 2), (1, 3)):
        pairs = {(e, g) for e, g in zip(log.sparse[:, entity], log.sparse[:, group])}
        assert len(pairs) == len({e for e, _ in pairs})


def test_labels_follow_the_planted_probability():
    (log,) = synthetic_click_log([40_000], TABLES, num_dense=2, seed=1)
    assert abs(log.labels.mean() - log.probability.mean()) < 0.01
    high = log.probability > 0.7
    assert abs(log.labels[high].mean() - log.probability[high].mean()) < 0.02


def test_auc_matches_scikit_learn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 2000)
    scores = np.round(rng.normal(labels * 0.7, 1.0), 1)  # rounding makes ties
    assert auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    assert auc([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1]) == 1.0
    assert auc([0.5, 0.5], [0, 1]) == 0.5
    with pytest.raises(ValueError, match="both clicks and non-clicks"):
        auc([0.1, 0.2], [1, 1])


def test_bayes_auc_is_the_auc_of_the_true_probabilities_and_beats_noisier_scores():
    data = ClickDataModule(table_sizes=TABLES, train_samples=100, val_samples=100, test_samples=20_000)
    data.setup()
    test = data.logs["test"]
    reference = data.reference_metrics()
    assert reference["test_bayes_auc"] == pytest.approx(auc(test.probability, test.labels))
    noisy = test.probability + np.random.default_rng(0).normal(0, 0.2, len(test))
    assert auc(noisy, test.labels) < reference["test_bayes_auc"]
    assert 0.7 < reference["test_bayes_auc"] < 0.95


def test_tables_dominate_the_default_model():
    model = DLRM().build()
    tables = sum(p.numel() for n, p in model.named_parameters() if n.startswith("embeddings."))
    assert tables / sum(p.numel() for p in model.parameters()) > 0.9


def test_forward_shape_loss_and_plan():
    torch.manual_seed(0)
    model = DLRM(num_dense=3, table_sizes=TABLES, embedding_dim=8).build()
    (log,) = synthetic_click_log([32], TABLES, num_dense=3)
    dense, sparse, labels = log.dataset().tensors
    logits = model(dense, sparse)
    assert logits.shape == (32,)
    loss = model.pipeline_loss(logits, labels)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert torch.equal(model.predict_step((dense, sparse, labels)), logits)
    assert set(concrete_plan(model, adapter=adapt(model))) == {f"embeddings.{j}" for j in range(len(TABLES))}
    assert not callable(getattr(model, "pipeline_layers", None))  # not a chain: pipelines refuse it


def test_criteo_tsv_is_parsed_and_hashed(tmp_path):
    lines = [
        "\t".join(["1", *["3", "", "-2"] + ["0"] * 10, *["68fd1e64", ""] + ["aabbccdd"] * 24]),
        "\t".join(["0", *["1"] * 13, *["0000000a"] * 26]),
    ]
    path = tmp_path / "day.tsv"
    path.write_text("\n".join(lines) + "\n")
    log = read_criteo_tsv(str(path), buckets=101)
    assert log.labels.tolist() == [1, 0] and log.probability is None
    assert log.dense[0, :3].tolist() == pytest.approx([np.log1p(3), 0.0, 0.0])
    assert log.sparse[0, 0] == int("68fd1e64", 16) % 100 + 1 and log.sparse[0, 1] == 0
    assert log.sparse[1, 0] == 11 and (log.sparse < 101).all()
    assert feature_table_sizes(str(path), TABLES, 101) == [101] * 26
    (tmp_path / "bad.tsv").write_text("1\t2\t3\n")
    with pytest.raises(ValueError, match="a Criteo line has 40"):
        read_criteo_tsv(str(tmp_path / "bad.tsv"), 101)
