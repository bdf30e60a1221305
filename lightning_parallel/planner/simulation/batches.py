"""One rank's batch on ``meta``, shaped as each recipe's data loader gives it, for the simulated step.

Only shapes and dtypes matter on ``meta``: token ids for language models (pairs, or Hugging Face dicts), images and
labels for the vision recipe, dense features, sparse ids and labels for the click-through (DLRM) recipe.
:func:`batch_of` picks the builder from a run's ``data`` config (``lp-simulate``'s, the same as ``lp-train``'s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Optional

import torch


def token_batch(batch_size: int, seq_len: int, as_dict: bool = False) -> Any:
    """Token ids of ``batch_size`` sequences of ``seq_len`` on ``meta``, as a language model's loader gives them.

    Args:
        batch_size: sequences (one data-parallel rank's batch).
        seq_len: tokens per sequence.
        as_dict: a Hugging Face batch (``input_ids``, ``labels``) instead of ``(inputs, targets)``; without an
            attention mask (transformers reads a mask's values to choose its attention path, which ``meta`` has
            none of): every token attends causally, as in packed rows.
    """
    tokens = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    if as_dict:
        return {"input_ids": tokens, "labels": tokens.clone()}
    return tokens, tokens.clone()


def image_batch(batch_size: int, channels: int, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [batch, channels, side, side] float, labels [batch] long)`` on ``meta`` (the vision recipe's).

    Args:
        batch_size: images (one data-parallel rank's batch).
        channels: colour channels.
        image_size: the side in pixels.
    """
    images = torch.zeros(batch_size, channels, image_size, image_size, device="meta")
    return images, torch.zeros(batch_size, dtype=torch.long, device="meta")


def click_batch(batch_size: int, num_dense: int, num_sparse: int) -> tuple[torch.Tensor, ...]:
    """``(dense [batch, num_dense] float, sparse ids [batch, num_sparse] long, labels [batch] long)`` on ``meta``
    (the click-through recipe's: one id per table).

    Args:
        batch_size: samples (one data-parallel rank's batch).
        num_dense: dense features.
        num_sparse: sparse features (embedding tables).
    """
    dense = torch.zeros(batch_size, num_dense, device="meta")
    sparse = torch.zeros(batch_size, num_sparse, dtype=torch.long, device="meta")
    return dense, sparse, torch.zeros(batch_size, dtype=torch.long, device="meta")


def batch_of(data: Optional[Mapping[str, Any]]) -> Optional[Callable[[], Any]]:
    """One rank's batch on ``meta`` for a run's data config, or None (no step) for data it does not know.

    Token ids of ``batch_size`` x ``seq_len`` (dict batches for the Hugging Face data modules, whose ``_target_``
    names ``hf``); images of ``channels`` x ``image_size`` squared; clicks of ``num_dense`` features and one id per
    ``table_sizes`` entry (the synthetic click log; a Criteo file's widths are read from the file: no step).

    Args:
        data: the run's ``data`` config group (``lp-train``'s), or None.
    """
    data = data or {}
    size = data.get("batch_size")
    if size is None:
        return None
    if data.get("seq_len") is not None:
        return partial(token_batch, int(size), int(data["seq_len"]), "hf" in str(data.get("_target_", "")))
    if data.get("image_size") is not None:
        return partial(image_batch, int(size), int(data.get("channels", 3)), int(data["image_size"]))
    if data.get("table_sizes") is not None and data.get("path") is None:
        return partial(click_batch, int(size), int(data.get("num_dense", 0)), len(data["table_sizes"]))
    return None
