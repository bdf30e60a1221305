"""Recommendation recipe: a DLRM-style click model with row-sharded embedding tables, on a synthetic click log."""

from examples.recsys.data import ClickDataModule
from examples.recsys.model import DLRM

__all__ = ["DLRM", "ClickDataModule"]
