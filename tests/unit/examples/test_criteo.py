"""Criteo-format TSV for the TorchRec DLRM without processes: chunked reading, hashing into each table, missing
categories as empty bags, batches as ``KeyedJaggedTensor`` s, and bad files refused with their line."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec")

from examples.recsys.criteo import CriteoClickDataModule, read_criteo_log  # noqa: E402
from tests.distributed.examples.test_criteo_torchrec import TABLE_SIZES, write_criteo  # noqa: E402


def test_chunks_read_as_the_whole_file_and_categories_hash_into_each_table(tmp_path):
    path = write_criteo(tmp_path / "day.tsv", lines=250)
    whole = read_criteo_log(path, TABLE_SIZES, chunk_rows=10_000)
    chunked = read_criteo_log(path, TABLE_SIZES, chunk_rows=7)
    assert np.array_equal(whole.dense, chunked.dense) and np.array_equal(whole.labels, chunked.labels)
    for j, rows in enumerate(TABLE_SIZES):
        assert np.array_equal(whole.offsets[j], chunked.offsets[j]) and np.array_equal(whole.values[j],
                                                                                       chunked.values[j])
        assert whole.values[j].max() < rows
    first = path.read_text().splitlines()[0].split("\t")
    for j, value in enumerate(first[14:]):  # line 0: a present category is one id, a missing one an empty bag
        bag = whole.values[j][whole.offsets[j][0]:whole.offsets[j][1]].tolist()
        assert bag == ([int(value, 16) % TABLE_SIZES[j]] if value else [])
    assert np.allclose(whole.dense[0], np.log1p([float(v) if v else 0.0 for v in first[1:14]]))
    assert len(read_criteo_log(path, TABLE_SIZES, max_rows=30)) == 30


def test_batches_are_keyed_jagged_tensors_with_empty_bags(tmp_path):
    data = CriteoClickDataModule(str(write_criteo(tmp_path / "day.tsv", lines=200)), TABLE_SIZES, val_fraction=0.1,
                                 batch_size=16, shuffle=False)
    data.setup()
    assert (len(data.train_log), len(data.val_log)) == (180, 20)  # the last lines are validation
    dense, kjt, labels = next(iter(data.train_dataloader()))
    assert dense.shape == (16, 13) and labels.shape == (16,) and len(kjt.keys()) == 26
    lengths = kjt.lengths()
    assert set(lengths.tolist()) == {0, 1} and 0 < int((lengths == 0).sum()) < len(lengths) // 2


@pytest.mark.parametrize("content, message", [
    ("1\t2\t3\n", "has 3 tab-separated fields"),
    ("x" + "\t" * 39 + "\n", "a 0/1 label"),
    ("", "holds no lines"),
])
def test_bad_files_are_refused_with_their_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_criteo_log(path, TABLE_SIZES)


def test_the_table_count_and_a_missing_path_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="give 26 sizes"):
        read_criteo_log(write_criteo(tmp_path / "day.tsv", lines=5), [10] * 8)
    with pytest.raises(ValueError, match="data.path=/path/to/train.txt"):
        CriteoClickDataModule(None, TABLE_SIZES)


def test_recsys_criteo_experiment_composes_26_tables_on_the_users_file(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from lightning_parallel.cli.train import CONFIG_DIR

    path = write_criteo(tmp_path / "day.tsv", lines=50)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=recsys_criteo", f"data.path={path}",
                                           "paths.output_dir=/tmp/lp-recsys-criteo"])
    data = instantiate(cfg.data)
    assert len(cfg.model.table_sizes) == 26 and data.table_sizes == list(cfg.model.table_sizes)
    assert cfg.strategy.sharding == "table_wise" and cfg.model.num_dense == 13


def test_collate_gathers_each_samples_ids_in_order():
    from examples.recsys.torchrec_data import CollateJagged, feature_names, make_click_log

    log = make_click_log(50, [30, 20, 10], max_ids_per_feature=4, seed=3)
    indices = [7, 0, 42, 7, 13]
    _, kjt, _ = CollateJagged(log, feature_names(3))(indices)
    for j, key in enumerate(feature_names(3)):
        expected = [log.values[j][log.offsets[j][i]:log.offsets[j][i + 1]].tolist() for i in indices]
        assert [t.tolist() for t in kjt[key].to_dense()] == expected
