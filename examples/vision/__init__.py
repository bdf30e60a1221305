"""Vision recipe: a small Vision Transformer on scikit-learn's bundled handwritten digits (no download)."""

from .data import ImageDataModule
from .model import ViT

__all__ = ["ImageDataModule", "ViT"]
