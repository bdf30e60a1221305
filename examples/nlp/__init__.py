"""NLP recipe: a small GPT-style decoder trained on byte-level text that ships with Python."""

from .data import TextDataModule
from .model import GPT

__all__ = ["GPT", "TextDataModule"]
