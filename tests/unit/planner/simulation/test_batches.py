"""The simulated step's batch for each recipe's data config: token ids, Hugging Face dicts, images, clicks."""

from lightning_parallel.planner.simulation.batches import batch_of


def test_each_recipes_data_config_gives_its_loaders_batch_shapes_on_meta():
    tokens, targets = batch_of({"batch_size": 4, "seq_len": 16})()
    hf = batch_of({"_target_": "lightning_parallel.examples.nlp.hf_data.HFTextDataModule", "batch_size": 2,
                   "seq_len": 8})()
    images, labels = batch_of({"batch_size": 64, "image_size": 8, "channels": 1})()
    dense, sparse, clicks = batch_of({"batch_size": 512, "num_dense": 4, "table_sizes": [4096, 2048, 32]})()

    assert tokens.shape == targets.shape == (4, 16) and tokens.is_meta
    assert set(hf) == {"input_ids", "labels"} and hf["input_ids"].shape == (2, 8)
    assert images.shape == (64, 1, 8, 8) and images.is_floating_point() and labels.shape == (64,)
    assert dense.shape == (512, 4) and sparse.shape == (512, 3) and not sparse.is_floating_point()
    assert clicks.shape == (512,)


def test_data_whose_shapes_come_from_its_files_gives_no_step():
    assert batch_of({"batch_size": 512, "table_sizes": [4096], "path": "day_0.tsv"}) is None  # Criteo widths
    assert batch_of({"batch_size": 8}) is None and batch_of(None) is None
