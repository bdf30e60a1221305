"""The ``hugging_face`` entry the suite's strategies save beside Lightning's checkpoint state.

``lp-convert CKPT OUT --to hf`` builds the Hugging Face class from it and strips the prefix,
so a checkpoint of a LightningModule holding a ``PreTrainedModel`` converts without a
``--hf-config``. Plain values only (the config's ``to_dict()``), so ``meta.pt`` stays
readable with ``weights_only=True``.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

HF_KEY = "hugging_face"


def hugging_face_entry(module: nn.Module) -> Optional[dict[str, Any]]:
    """``{"prefix", "class", "config"}`` of the Hugging Face model inside ``module``, or None.

    Args:
        module: the LightningModule being saved.

    Note:
        Two unrelated Hugging Face models in one module (a policy and a reference model) have
        no single export: the entry is left out rather than failing the save; ``--hf-config``
        then says which to export.
    """
    from lightning_parallel.adapters.hf import find_hf_model

    try:
        found = find_hf_model(module)
    except ValueError:
        return None
    if found is None:
        return None
    prefix, model = found
    return {"prefix": prefix, "class": type(model).__name__, "config": model.config.to_dict()}


def add_hugging_face_entry(checkpoint: dict[str, Any], module: nn.Module) -> None:
    """Put :func:`hugging_face_entry` under ``checkpoint["hugging_face"]`` when ``module`` holds a Hugging Face model.

    Args:
        checkpoint: Lightning's checkpoint dict being saved (modified in place).
        module: the LightningModule being saved.
    """
    entry = hugging_face_entry(module)
    if entry is not None:
        checkpoint[HF_KEY] = entry
