"""Start training from a Hugging Face ``save_pretrained`` folder under any layout, each rank reading only its shard.

The folder's keys are matched to the model's as ``from_pretrained`` matches them (the model's conversion mapping:
a mixture-of-experts folder's per-expert keys fill the fused ``experts.gate_up_proj``/``down_proj``, each rank
stacking only the experts it owns; :mod:`lightning_parallel.checkpoints.hf.load`). ``lp-train`` checks the folder
against the model on ``meta`` before any process starts; a mismatch names what differs.

With ``lp-train`` and the HF recipe, ``model.pretrained=DIR`` alone takes the folder's config, vocabulary and
weights (the recipe adds this callback itself). For any other module, add it from the command line::

    lp-train ... +callbacks.hf_weights._target_=lightning_parallel.callbacks.HuggingFaceWeights \
                 +callbacks.hf_weights.folder=DIR

or in a callbacks config (``conf/callbacks/<name>.yaml``)::

    hf_weights:
      _target_: lightning_parallel.callbacks.HuggingFaceWeights
      folder: /path/to/save_pretrained_folder
      # prefix: "model."     # the model's attribute path; found by itself when the module holds one model

Note:
    The weights are loaded in ``on_fit_start`` (and ``on_validation_start``/``on_test_start``/
    ``on_predict_start`` outside ``fit``): Lightning calls these after the strategy's
    ``setup`` has split and sharded the module and built the optimizers, and before any
    training or evaluation step. A run resumed with ``ckpt_path`` skips the folder when
    Lightning has already restored the checkpoint at that point (``trainer.ckpt_path`` set);
    strategies that restore after setup (``restore_checkpoint_after_setup``, as the suite's
    do) restore it right after this hook, so the checkpoint wins either way.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from lightning_parallel.adapters import adapt
from lightning_parallel.checkpoints.hf.load import load_hf_weights
from lightning_parallel.runtime.log import rank_zero_info


def hf_model_prefix(module: pl.LightningModule) -> str:
    """The attribute path (plus a dot; ``""`` for the model itself) of the Hugging Face model inside ``module``.

    Raises:
        ValueError: the module holds none, or several unrelated ones.
    """
    prefix = adapt(module).weights_prefix()
    if prefix is None:
        raise ValueError(
            f"{type(module).__name__} holds no transformers PreTrainedModel: pass prefix= to HuggingFaceWeights."
        )
    return prefix


class HuggingFaceWeights(pl.Callback):
    """Load a local ``save_pretrained`` folder into the (parallelised) LightningModule before it trains.

    Args:
        folder: the folder (``config.json``, ``model.safetensors`` or shards with an index file).
        prefix: the attribute path of the Hugging Face model in the LightningModule plus a
            dot (``"model."``); default: found as the first ``PreTrainedModel`` submodule.

    Attributes:
        report: after loading, ``{"tensors": ..., "bytes_read": ...}`` of this rank.
    """

    def __init__(self, folder: str | Path, prefix: Optional[str] = None) -> None:
        self.folder, self.prefix = Path(folder), prefix
        self.report: dict[str, int] = {}
        self._loaded: "weakref.WeakSet[pl.LightningModule]" = weakref.WeakSet()

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module in self._loaded:
            return
        self._loaded.add(pl_module)
        if trainer.ckpt_path:
            rank_zero_info(f"HuggingFaceWeights: {trainer.ckpt_path} is restored; {self.folder} is not loaded.")
            return
        prefix = self.prefix if self.prefix is not None else hf_model_prefix(pl_module)
        error: Optional[str] = None
        try:
            self.report = load_hf_weights(pl_module, self.folder, prefix)
        except ValueError as raised:
            error = str(raised)
        # Ranks hold different stages: one that fails must stop every rank, not leave them in a collective.
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((f"rank {rank}: {e}" for rank, e in enumerate(errors) if e), None)
        if error:
            raise ValueError(error)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(trainer, pl_module)
