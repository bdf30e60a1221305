"""``data=image_folder`` without processes: the ImageFolder layout, transforms at the model's resolution, the
augmentation a function of (seed, epoch, image), mistakes refused with the fix, and the experiments' configs."""

from __future__ import annotations

import pytest
import torch

from examples.vision.image_folder import ImageFolderDataModule, list_image_folder
from tests.distributed.examples.test_image_folder_layouts import write_image_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("images"), classes=3, per_class=10)


def test_folder_layout_classes_and_transformed_sizes(folder):
    files, labels, classes = list_image_folder(folder)
    assert classes == ["class0", "class1", "class2"] and len(files) == 30 and labels.tolist() == sorted(labels.tolist())
    data = ImageFolderDataModule(str(folder), image_size=24, num_classes=3, batch_size=4, val_fraction=0.2)
    data.setup()
    images, targets = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 24, 24) and targets.dtype == torch.int64
    val_images, _ = data.val_files[0]
    assert val_images.shape == (3, 24, 24) and torch.equal(val_images, data.val_files[0][0])  # no randomness
    assert abs(float(val_images.mean())) < 3  # normalised


def test_augmentation_is_seeded_by_image_and_epoch(folder):
    data = ImageFolderDataModule(str(folder), image_size=16, num_classes=3, batch_size=4, val_fraction=0.2)
    data.setup()
    loader = data.train_dataloader()
    first, again = data.train_files[3][0], data.train_files[3][0]
    loader.sampler.set_epoch(1)
    later = data.train_files[3][0]
    assert torch.equal(first, again) and not torch.equal(first, later)


@pytest.mark.parametrize("kwargs, message", [
    (dict(path=None), "data.path=/path/to/train"),
    (dict(num_classes=5), "set data.num_classes=3"),
    (dict(channels=2), "must be 1 \\(grey\\) or 3"),
    (dict(cache_size=8), "set data.cache_size=18 or more"),
])
def test_mistakes_are_refused_with_the_fix(folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        data = ImageFolderDataModule(**{"path": str(folder), "image_size": 16, "num_classes": 3, **kwargs})
        data.setup()


def test_a_folder_with_one_class_is_refused(tmp_path):
    write_image_folder(tmp_path, classes=1, per_class=2)
    with pytest.raises(ValueError, match="two classes or more"):
        list_image_folder(tmp_path)


@pytest.mark.parametrize("overrides, tokens, width", [
    ([], 64, 64), (["model=vit_b16", "data.image_size=224"], 196, 768),
])
def test_vision_folder_experiment_sizes_the_model_by_the_images(folder, overrides, tokens, width):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_parallel.cli.train import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=vision_folder", f"data.path={folder}", "data.num_classes=3",
                                           *overrides, "paths.output_dir=/tmp/lp-vision-folder"])
    assert (cfg.model.image_size // cfg.model.patch_size) ** 2 == tokens and cfg.model.d_model == width
    assert cfg.model.num_classes == 3 and cfg.model.in_channels == 3


def test_decoded_cache_is_written_once_and_serves_the_same_shapes(folder, tmp_path):
    options = dict(image_size=16, num_classes=3, batch_size=4, val_fraction=0.2, cache_size=20, cache_dir=str(tmp_path))
    data = ImageFolderDataModule(str(folder), **options)
    data.setup()
    written = sorted(tmp_path.glob("*.u8"))
    assert len(written) == 2 and written[0].stat().st_size in (24 * 20 * 20 * 3, 6 * 20 * 20 * 3)
    again = ImageFolderDataModule(str(folder), **options)
    again.setup()
    assert sorted(tmp_path.glob("*.u8")) == written and [p.stat().st_mtime_ns for p in written] == [
        p.stat().st_mtime_ns for p in sorted(tmp_path.glob("*.u8"))]
    cached, plain = again.val_files[0][0], ImageFolderDataModule(str(folder), **{**options, "cache_size": None})
    plain.setup()
    assert cached.shape == plain.val_files[0][0].shape == (3, 16, 16)
    assert (cached - plain.val_files[0][0]).abs().mean() < 0.2  # the same picture, resized twice
