"""Your image folders for the ViT recipe (``data=image_folder``): ``root/<class>/<image>``, decoded in loader workers.

The layout is torchvision's ``ImageFolder`` (class ids in sorted folder order, files sorted), and so are the
transforms, at the resolution the model asks (``image_size``): training images get a random resized crop (area
``crop_scale`` of the image, aspect 3/4 to 4/3) and a horizontal flip, evaluation images are resized to
``image_size / 0.875`` and centre-cropped; both are normalised (ImageNet's mean and std for RGB). Files are listed
once and decoded by Pillow in ``__getitem__``, so ``num_workers`` loader workers decode and transform in parallel
and nothing but the file list is held in memory.

Note:
    * torchvision is not used: its PyPI wheel does not import beside the CPU build of torch the project pins
      (``operator torchvision::nms does not exist``, torchvision 0.28 with torch 2.13.0+cpu); the transforms are
      Pillow's, a few lines each.
    * A training image's crop and flip are drawn from a generator seeded by ``(seed, epoch, index)``: the same
      image gets the same augmentation at every layout, in any worker, and after a resume -- so layouts can be
      compared number for number, and a resumed run continues exactly. The epoch is read from the loader's
      sampler (Lightning sets it before each epoch's workers start).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_parallel.resumable_loader import resumable_loader

from .data import IMAGE_SUFFIXES, stratified_split

RGB_MEAN, RGB_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as torchvision's recipes use
EVAL_CROP = 0.875  # the usual resize-then-centre-crop ratio (256 -> 224)


def list_image_folder(root: str | Path) -> tuple[list[Path], np.ndarray, list[str]]:
    """``(files, labels, classes)`` of an ``ImageFolder`` layout (classes: sorted sub-folder names).

    Raises:
        ValueError: not a folder, or fewer than two classes with images.
    """
    base = Path(root).expanduser()
    if not base.is_dir():
        raise ValueError(f"data.path={str(root)!r} is not a folder: point it at root/<class>/<image> (ImageFolder).")
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    files, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(f for f in (base / name).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        files.extend(found)
        labels.extend([label] * len(found))
    if len(classes) < 2 or not files:
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        raise ValueError(f"{str(root)!r} holds {len(classes)} class folder(s) and {len(files)} image(s): an "
                         f"ImageFolder layout needs root/<class>/<image> with two classes or more ({suffixes}).")
    return files, np.asarray(labels, dtype=np.int64), classes


def random_resized_crop(image: Any, size: int, rng: np.random.Generator, scale: tuple[float, float]) -> Any:
    """torchvision's ``RandomResizedCrop`` with Pillow: a crop of ``scale`` of the area, aspect 3/4-4/3, resized."""
    from PIL import Image

    width, height = image.size
    for _ in range(10):
        area = width * height * rng.uniform(*scale)
        ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        w, h = int(round((area * ratio) ** 0.5)), int(round((area / ratio) ** 0.5))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    return center_crop(image, size, 1.0)  # no crop fitted: the whole centre, as torchvision falls back


def center_crop(image: Any, size: int, ratio: float = EVAL_CROP) -> Any:
    """Resize the shorter side to ``size / ratio``, then crop the centre ``size x size``."""
    from PIL import Image

    width, height = image.size
    short = size / ratio
    w, h = max(size, round(width * short / min(width, height))), max(size, round(height * short / min(width, height)))
    image = image.resize((w, h), Image.BILINEAR)
    left, top = (w - size) // 2, (h - size) // 2
    return image.crop((left, top, left + size, top + size))


class DecodedImages:
    """Images decoded once to ``size x size`` uint8 pixels in a memory-mapped file (``cache_size``): a worker then
    crops and resizes a small array instead of decoding a file (``benchmarks/loader_throughput.py``: 3-4x).

    Args:
        files: image paths.
        size: the stored side (images are resized to it whole, aspect not kept; keep it above ``image_size``).
        channels: 1 or 3.
        folder: where the file goes (named by a hash of the files, their sizes and times, and ``size``).
    """

    def __init__(self, files: list[Path], size: int, channels: int, folder: Path) -> None:
        digest = hashlib.sha256(f"{size}|{channels}".encode())
        for file in files:
            stat = file.stat()
            digest.update(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        self.path, self.shape = folder / f"{digest.hexdigest()[:20]}.u8", (len(files), size, size, channels)
        self._map: Optional[np.ndarray] = None
        if not self.path.is_file():
            self._write(files, size, channels)

    def _write(self, files: list[Path], size: int, channels: int) -> None:
        from PIL import Image

        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as handle:
            for file in files:
                with Image.open(file) as image:
                    pixels = image.convert("L" if channels == 1 else "RGB").resize((size, size), Image.BILINEAR)
                    handle.write(np.asarray(pixels, dtype=np.uint8).reshape(size, size, channels).tobytes())
        os.replace(partial, self.path)  # atomic: a reader sees no file or the whole one

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}

    def image(self, index: int) -> Any:
        """Image ``index`` as a Pillow image."""
        from PIL import Image

        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", shape=self.shape)
        pixels = np.array(self._map[index])
        return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)


class ImageFiles(Dataset):
    """Image files decoded and transformed when read (in the loader's workers).

    Args:
        files: image paths.
        labels: class id per file.
        image_size: side of the square images the model sees.
        channels: 1 (grey) or 3 (RGB).
        train: random resized crop and flip (else resize and centre crop).
        crop_scale: the area range of the training crop.
        seed: seed of the augmentation (with the epoch and the index).
    """

    def __init__(self, files: list[Path], labels: np.ndarray, image_size: int, channels: int = 3, train: bool = False,
                 crop_scale: tuple[float, float] = (0.35, 1.0), seed: int = 0) -> None:
        if channels not in (1, 3):
            raise ValueError(f"data.channels={channels} must be 1 (grey) or 3 (RGB).")
        self.files, self.labels, self.image_size, self.channels = list(files), labels, image_size, channels
        self.train, self.crop_scale, self.seed = train, tuple(crop_scale), seed
        mean, std = (RGB_MEAN, RGB_STD) if channels == 3 else ((0.5,), (0.5,))
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]
        self.sampler: Optional[Any] = None  # the training loader's sampler: its epoch seeds the augmentation
        self.cache: Optional[DecodedImages] = None  # decoded once (cache_size), else each file is decoded when read

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        from PIL import Image

        with (self.cache.image(index) if self.cache is not None else Image.open(self.files[index])) as image:
            image = image.convert("L" if self.channels == 1 else "RGB")
            if self.train:
                epoch = int(getattr(self.sampler, "epoch", 0))
                rng = np.random.default_rng([self.seed, epoch, index])
                image = random_resized_crop(image, self.image_size, rng, self.crop_scale)
                if rng.random() < 0.5:
                    image = image.transpose(Image.FLIP_LEFT_RIGHT)
            else:
                image = center_crop(image, self.image_size)
            array = np.asarray(image, dtype=np.float32) / 255.0
        pixels = torch.from_numpy(array[None] if self.channels == 1 else array.transpose(2, 0, 1).copy())
        return (pixels - self.mean) / self.std, torch.tensor(int(self.labels[index]))


class ImageFolderDataModule(pl.LightningDataModule):
    """An ``ImageFolder`` layout as ``(images, labels)`` batches at the model's resolution.

    Args:
        path: the folder (``root/<class>/<image>``).
        val_path: a validation folder with the same classes; None holds out ``val_fraction`` (stratified).
        image_size: side of the images the model sees (the model's ``image_size``).
        channels: 1 or 3.
        num_classes: classes the model predicts; checked against the folder.
        batch_size: images per data-parallel rank per step (evaluation too: pipeline stages keep one shape).
        val_fraction: share held out when ``val_path`` is None.
        split_seed: seed of that split.
        augment: random resized crop and flip on training images.
        crop_scale: the area range of the training crop.
        seed: seed of the augmentation.
        num_workers: loader workers (they decode and transform).
        cache_size: decode every image once to this side (:class:`DecodedImages`); None: decode files when read.
        cache_dir: where the decoded images go; default ``~/.cache/lightning_parallel/image_folder``.
    """

    def __init__(self, path: Optional[str] = None, val_path: Optional[str] = None, image_size: int = 32,
                 channels: int = 3, num_classes: int = 10, batch_size: int = 32, val_fraction: float = 0.1,
                 split_seed: int = 0, augment: bool = True, crop_scale: tuple[float, float] = (0.35, 1.0),
                 seed: int = 0, num_workers: int = 0, cache_size: Optional[int] = None,
                 cache_dir: Optional[str] = None) -> None:
        super().__init__()
        if path is None:
            raise ValueError("data=image_folder needs your folder: data.path=/path/to/train (root/<class>/<image>).")
        if channels not in (1, 3):
            raise ValueError(f"data.channels={channels} must be 1 (grey) or 3 (RGB).")
        if cache_size is not None and cache_size < image_size:
            raise ValueError(f"data.cache_size={cache_size} is below data.image_size={image_size}: the crops would be "
                             f"upsampled; set data.cache_size={round(image_size / EVAL_CROP)} or more.")
        self.save_hyperparameters()
        self.train_files: Optional[ImageFiles] = None
        self.val_files: Optional[Dataset] = None
        self.classes: list[str] = []

    def _files(self, train: bool, files: list[Path], labels: np.ndarray) -> ImageFiles:
        h = self.hparams
        images = ImageFiles(files, labels, h.image_size, h.channels, train and h.augment, h.crop_scale, h.seed)
        if h.cache_size is not None:
            folder = Path(h.cache_dir or "~/.cache/lightning_parallel/image_folder").expanduser()
            images.cache = DecodedImages(images.files, h.cache_size, h.channels, folder)
        return images

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_files is not None:
            return
        files, labels, self.classes = list_image_folder(self.hparams.path)
        if len(self.classes) != self.hparams.num_classes:
            raise ValueError(f"data.num_classes={self.hparams.num_classes} but {self.hparams.path!r} has "
                             f"{len(self.classes)} classes: set data.num_classes={len(self.classes)}.")
        if self.hparams.val_path is not None:
            val_files, val_labels, val_classes = list_image_folder(self.hparams.val_path)
            if val_classes != self.classes:
                raise ValueError(f"data.val_path holds classes {val_classes}, data.path {self.classes}: give both "
                                 "folders the same class sub-folders.")
            self.train_files, self.val_files = self._files(True, files, labels), self._files(False, val_files,
                                                                                               val_labels)
            return
        fraction = self.hparams.val_fraction
        if round(len(files) * fraction / 2) < len(self.classes):
            raise ValueError(f"data.val_fraction={fraction} of {len(files)} images holds out fewer than two per class "
                             f"({len(self.classes)} classes): raise it, or give data.val_path.")
        train, val, test = stratified_split(labels, fraction / 2, fraction / 2, self.hparams.split_seed)
        held_out = np.sort(np.concatenate([val, test]))
        self.train_files = self._files(True, [files[i] for i in train], labels[train])
        self.val_files = self._files(False, [files[i] for i in held_out], labels[held_out])

    def train_dataloader(self) -> DataLoader:
        # Sharded over data-parallel ranks, its position checkpointed; the sampler's epoch seeds the augmentation.
        loader = resumable_loader(self.train_files, batch_size=self.hparams.batch_size, trainer=self.trainer,
                                  num_workers=self.hparams.num_workers)
        self.train_files.sampler = loader.sampler
        return loader

    def val_dataloader(self) -> DataLoader:
        count = len(self.val_files) // self.hparams.batch_size * self.hparams.batch_size
        return DataLoader(Subset(self.val_files, range(count)), batch_size=self.hparams.batch_size,
                          num_workers=self.hparams.num_workers)
