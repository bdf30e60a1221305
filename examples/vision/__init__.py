"""Vision recipe: a small Vision Transformer on scikit-learn's bundled handwritten digits (no download)."""

from examples.vision.data import ImageDataModule
from examples.vision.model import ViT

__all__ = ["ImageDataModule", "ViT"]
