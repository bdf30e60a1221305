"""The text recipe's test split is its own data: held-out files alternate between validation and test."""

import torch

from examples.nlp.data import TextDataModule, load_corpus, load_splits


def test_test_split_is_held_out_data_the_run_never_validates_on(tmp_path):
    for i in range(20):  # every 5th file held out: 4 files, two for validation, two for test
        (tmp_path / f"{i:02d}.txt").write_text(f"file {i} " * 40)
    train, val, test = load_splits(str(tmp_path), max_bytes=10**6, val_every=5)
    old_train, held = load_corpus(str(tmp_path), max_bytes=10**6, val_every=5)
    assert torch.equal(train, old_train)  # the training data is what it was
    assert len(val) + len(test) == len(held) and len(val) > 0 and len(test) > 0
    val_text, test_text = bytes(val.tolist()), bytes(test.tolist())
    assert b"file 4 " in val_text and b"file 14 " in val_text and b"file 9 " in test_text and b"file 19 " in test_text
    assert b"file 9 " not in val_text and b"file 4 " not in test_text
    data = TextDataModule(path=str(tmp_path), seq_len=16, batch_size=2, val_every=5)
    data.setup()
    val_batch, test_batch = next(iter(data.val_dataloader()))[0], next(iter(data.test_dataloader()))[0]
    assert not torch.equal(val_batch, test_batch)
    assert torch.equal(next(iter(data.val_dataloader()))[0], val_batch)  # the test loader left validation as it was


def test_a_single_held_out_file_is_cut_in_half():
    import sysconfig
    from pathlib import Path

    one = next(p for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")) if p.stat().st_size > 4000)
    _, val, test = load_splits(str(one), max_bytes=10**6, val_every=10)
    assert abs(len(val) - len(test)) <= 1
