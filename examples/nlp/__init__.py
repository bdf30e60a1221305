"""NLP recipe: a small GPT-style decoder trained on byte-level text that ships with Python."""

from examples.nlp.data import TextDataModule
from examples.nlp.model import GPT

__all__ = ["GPT", "TextDataModule"]
