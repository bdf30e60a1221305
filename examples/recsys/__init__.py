"""Recommendation recipe: a DLRM-style click model with row-sharded embedding tables, on a synthetic click log."""

from .data import ClickDataModule
from .model import DLRM

__all__ = ["DLRM", "ClickDataModule"]
