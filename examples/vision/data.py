"""Image classification data that needs no download: scikit-learn's bundled handwritten digits.

By default the images are ``sklearn.datasets.load_digits()``: 1,797 real 8x8 grey scans of
handwritten digits (ten classes) that ship inside scikit-learn. They are split once,
stratified by class and with a fixed seed, into train / validation / test sets, so every
run and every layout sees the same three sets.

``path=`` points at an ImageFolder-style directory instead (``root/<class>/<image>``, class
ids in sorted folder order), read with Pillow; images are resized to ``image_size`` and
split the same way.

Note:
    torchvision is not used: its PyPI wheel does not import beside the CPU build of torch
    this project pins, and loading a folder of images needs only Pillow and numpy.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_parallel.resumable_loader import resumable_loader

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``(images (N, 1, 8, 8) float32 in [0, 1], labels (N,) int64)``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Pixel values are counts 0..16 of an 4x4 block of the original 32x32 bitmap.
    return (digits.images[:, None] / 16.0).astype(np.float32), digits.target.astype(np.int64)


def load_image_folder(root: str, image_size: int, channels: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read ``root/<class>/<image>`` files with Pillow.

    Args:
        root: folder holding one sub-folder per class.
        image_size: side every image is resized to.
        channels: 1 (converted to grey) or 3 (RGB).

    Returns:
        images ``(N, channels, image_size, image_size)`` float32 in [0, 1], labels ``(N,)``,
        and the class names (sorted folder names; label ``i`` is ``classes[i]``).
    """
    from PIL import Image

    base = Path(root).expanduser()
    if not base.is_dir():
        raise ValueError(f"data.path={root!r} is not a folder: point it at root/<class>/<image> (ImageFolder layout).")
    if channels not in (1, 3):
        raise ValueError(f"data.channels={channels} must be 1 (grey) or 3 (RGB).")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted((base / name).rglob("*")):
            if file.suffix.lower() in IMAGE_SUFFIXES and file.is_file():
                with Image.open(file) as image:
                    image = image.convert("L" if channels == 1 else "RGB").resize((image_size, image_size))
                    array = np.asarray(image, dtype=np.float32) / 255.0
                images.append(array[None] if channels == 1 else array.transpose(2, 0, 1))
                labels.append(label)
    if len(classes) < 2 or not images:
        raise ValueError(
            f"{root!r} holds {len(classes)} class folder(s) and {len(images)} image(s): an ImageFolder layout needs "
            f"root/<class>/<image> with at least two classes (suffixes {', '.join(sorted(IMAGE_SUFFIXES))})."
        )
    return np.stack(images), np.asarray(labels, dtype=np.int64), classes


def stratified_split(
    labels: np.ndarray, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of a class-stratified train / validation / test split, fixed by ``seed``.

    Args:
        labels: class id per sample.
        val_fraction: share of all samples for validation.
        test_fraction: share of all samples for test.
        seed: seed of the split (not the run's seed: the split must not change between runs).
    """
    from sklearn.model_selection import train_test_split

    if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
        raise ValueError(
            f"val_fraction={val_fraction} and test_fraction={test_fraction} must be in (0, 1) and sum below 1."
        )
    index = np.arange(len(labels))
    rest, test = train_test_split(index, test_size=test_fraction, stratify=labels, random_state=seed)
    val_share = val_fraction / (1 - test_fraction)
    train, val = train_test_split(rest, test_size=val_share, stratify=labels[rest], random_state=seed)
    return np.sort(train), np.sort(val), np.sort(test)


class ShiftedImages(Dataset):
    """Training images with a random shift of up to ``max_shift`` pixels (zero padding): the
    one augmentation that keeps an 8x8 digit legible.

    Args:
        images: ``(N, C, H, W)`` images.
        labels: ``(N,)`` class ids.
        max_shift: largest shift in pixels along each axis (0: no augmentation).
    """

    def __init__(self, images: Tensor, labels: Tensor, max_shift: int) -> None:
        self.images, self.labels, self.max_shift = images, labels, max_shift

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = self.images[index]
        if self.max_shift:
            s = self.max_shift
            dy, dx = torch.randint(-s, s + 1, (2,)).tolist()
            size_h, size_w = image.shape[-2:]
            padded = torch.nn.functional.pad(image, (s, s, s, s))
            image = padded[:, s + dy : s + dy + size_h, s + dx : s + dx + size_w]
        return image, self.labels[index]


class ImageDataModule(pl.LightningDataModule):
    """Images and class labels as ``(images, labels)`` batches.

    Args:
        path: ImageFolder-style folder; ``None`` for scikit-learn's digits (8x8, grey, 10 classes).
        image_size: side of the images the model sees (digits are 8; a folder is resized to it).
        channels: 1 or 3; must be 1 for the digits.
        num_classes: classes the model predicts; checked against the data.
        batch_size: samples per device per step; evaluation uses the same size (pipeline
            stages are built for one batch shape).
        val_fraction: share of the data for validation.
        test_fraction: share of the data for test.
        split_seed: seed of the stratified split.
        max_shift: random-shift augmentation of training images, in pixels.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        path: str | None = None,
        image_size: int = 8,
        channels: int = 1,
        num_classes: int = 10,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        max_shift: int = 1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if path is None and (image_size != 8 or channels != 1):
            raise ValueError(
                f"The digits are 8x8 grey images: keep data.image_size=8 and data.channels=1 (got {image_size}, "
                f"{channels}), or set data.path to an image folder."
            )
        self.save_hyperparameters()
        self.splits: dict[str, TensorDataset] | None = None
        self.classes: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        if self.splits is not None:
            return
        hp = self.hparams
        if hp.path is None:
            images, labels = load_digits_images()
            self.classes = [str(i) for i in range(10)]
        else:
            images, labels, self.classes = load_image_folder(hp.path, hp.image_size, hp.channels)
        if len(self.classes) != hp.num_classes:
            raise ValueError(
                f"data.num_classes={hp.num_classes} but the data has {len(self.classes)} classes: "
                f"set data.num_classes={len(self.classes)}."
            )
        train, val, test = stratified_split(labels, hp.val_fraction, hp.test_fraction, hp.split_seed)
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        self.splits = {
            name: TensorDataset(x[idx], y[idx]) for name, idx in (("train", train), ("val", val), ("test", test))
        }

    def train_dataset(self, augment: bool = True) -> Dataset:
        """The training split (randomly shifted when ``augment`` and ``max_shift > 0``)."""
        self.setup()
        images, labels = self.splits["train"].tensors
        return ShiftedImages(images, labels, self.hparams.max_shift if augment else 0)

    def train_dataloader(self) -> DataLoader:
        # Lightning checkpoints this loader's position: a mid-epoch resume neither repeats nor skips a sample.
        return resumable_loader(
            self.train_dataset(),
            batch_size=self.hparams.batch_size,
            trainer=self.trainer,
            num_workers=self.hparams.num_workers,
        )

    def _eval_loader(self, split: str) -> DataLoader:
        # drop_last: pipelined evaluation needs the training batch shape. The evaluation
        # report (EvaluationReport) reads the whole split from loader.dataset, padding the
        # last batch, so accuracy still counts every sample.
        self.setup()
        return DataLoader(
            self.splits[split], batch_size=self.hparams.batch_size, drop_last=True, num_workers=self.hparams.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
