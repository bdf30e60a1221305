"""The vision recipe: model shapes, protocol, data split and image-folder loading."""

import numpy as np
import pytest
import torch

from examples.vision.data import ImageDataModule, load_image_folder, stratified_split
from examples.vision.model import ViT
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.tensor.plan import concrete_plan


def test_forward_shapes_and_pipeline_layers_compose():
    torch.manual_seed(0)
    model = ViT(d_model=16, n_layer=3, n_head=2).build().eval()
    images = torch.rand(5, 1, 8, 8)
    logits = model(images)
    assert logits.shape == (5, 10)
    x = images
    for layer in model.pipeline_layers():
        x = layer(x)
    torch.testing.assert_close(x, logits)
    names = {name for name, _ in model.named_children()}
    assert {"patch_embed", "blocks", "head"} <= names and "blocks.2.attn.q.weight" in dict(model.named_parameters())


def test_tensor_plan_resolves_to_the_attention_and_mlp_of_every_block():
    model = ViT(n_layer=2).build()
    plan = concrete_plan(model, adapter=adapt(model))
    parts = ("attn", "attn.q", "attn.k", "attn.v", "attn.out", "mlp", "mlp.up", "mlp.down")
    assert set(plan) == {f"blocks.{i}.{m}" for i in range(2) for m in parts}


def test_bad_sizes_say_what_to_change():
    with pytest.raises(ValueError, match="n_head=3 must divide d_model=16"):
        ViT(d_model=16, n_head=3)
    with pytest.raises(ValueError, match="patch_size=3 must divide image_size=8"):
        ViT(patch_size=3)


def test_digits_split_is_fixed_stratified_and_disjoint():
    data = ImageDataModule()
    data.setup()
    sizes = {name: len(ds) for name, ds in data.splits.items()}
    assert sum(sizes.values()) == 1797 and sizes["test"] == 360
    labels = {name: ds.tensors[1].numpy() for name, ds in data.splits.items()}
    for name in ("val", "test"):  # each class keeps its share (stratified)
        share = np.bincount(labels[name], minlength=10) / len(labels[name])
        assert np.abs(share - 0.1).max() < 0.03
    a, b, c = stratified_split(np.repeat(np.arange(10), 50), 0.1, 0.2, seed=0)
    a2, _, c2 = stratified_split(np.repeat(np.arange(10), 50), 0.1, 0.2, seed=0)
    assert (a == a2).all() and (c == c2).all() and not set(a) & set(b) | set(a) & set(c) | set(b) & set(c)
    images, _ = data.splits["train"].tensors
    assert images.shape[1:] == (1, 8, 8) and 0.0 <= images.min() and images.max() <= 1.0


def test_batches_are_image_label_pairs_of_one_shape():
    data = ImageDataModule(batch_size=32)
    data.setup()
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (32, 1, 8, 8) and labels.dtype == torch.long
    assert all(len(batch[1]) == 32 for batch in data.val_dataloader())  # pipelined evaluation needs one shape


def test_shift_augmentation_keeps_shape_and_moves_pixels():
    data = ImageDataModule(max_shift=1)
    torch.manual_seed(0)
    shifted = data.train_dataset(augment=True)
    plain = data.train_dataset(augment=False)
    assert shifted[0][0].shape == plain[0][0].shape
    assert any(not torch.equal(shifted[i][0], plain[i][0]) for i in range(20))


def test_image_folder_is_read_with_pillow(tmp_path):
    from PIL import Image

    for name, value in (("cat", 40), ("dog", 200)):
        (tmp_path / name).mkdir()
        for i in range(6):
            Image.fromarray(np.full((12, 12, 3), value + i, dtype=np.uint8)).save(tmp_path / name / f"{i}.png")
    images, labels, classes = load_image_folder(str(tmp_path), image_size=8, channels=3)
    assert images.shape == (12, 3, 8, 8) and classes == ["cat", "dog"] and labels.tolist() == [0] * 6 + [1] * 6
    data = ImageDataModule(
        path=str(tmp_path), channels=3, num_classes=2, val_fraction=0.25, test_fraction=0.25, batch_size=2
    )
    data.setup()
    assert sum(len(ds) for ds in data.splits.values()) == 12
    with pytest.raises(ValueError, match="set data.num_classes=2"):
        ImageDataModule(path=str(tmp_path), channels=3, num_classes=10).setup()
    with pytest.raises(ValueError, match="ImageFolder"):
        load_image_folder(str(tmp_path / "missing"), 8, 1)
