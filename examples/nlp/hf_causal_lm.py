"""A Hugging Face ``transformers`` causal language model as a plain LightningModule.

The module holds ``AutoModelForCausalLM.from_config(...)`` and returns the model's own loss:
nothing in it says how to split the model. The suite's strategies read that from the model
itself (its ``tp_plan`` and ``pp_plan``, config head counts and tied weights), so the same
module trains on one device, under DDP and DeepSpeed, and under tensor, pipeline and hybrid
parallelism.

Note:
    * ``config`` is a ``model_type`` that ``transformers`` knows (``llama``, ``qwen2``,
      ``mistral``, ...) built at a tiny size (:data:`TINY_SHAPE`, random weights, nothing
      downloads), or a local folder holding a ``config.json``.
    * ``transformers`` is the optional extra ``hf`` and is imported only when the model is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..optimization import weight_decay_groups, with_warmup_cosine

# Small enough for CPU tests; 4 heads over 2 key/value heads shard over 2 tensor ranks, 4 layers
# make 2 pipeline stages of 2 layers, or 4 stages for interleaved schedules.
TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,  # byte 0 (NUL) never occurs in text: the padding id of the byte-level data
    "bos_token_id": 2,
    "eos_token_id": 3,
}

# What a family's tiny config changes beyond TINY_SHAPE: each is set like the family's small released models.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    # Sliding-window attention as Mistral-7B-v0.1's, the window scaled to the tiny context (else it is a Llama).
    "mistral": {"tie_word_embeddings": False, "sliding_window": 8},
    "qwen2": {"tie_word_embeddings": True},  # as Qwen2-0.5B/1.5B: the LM head is the token embedding
}


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            "model=hf_causal_lm needs Hugging Face transformers: pip install -e '.[hf]'"
        ) from error


def build_config(config: str, overrides: Optional[dict[str, Any]] = None, vocab_size: Optional[int] = None) -> Any:
    """A ``transformers`` config: a tiny one of a named family, or the one in a local folder.

    Args:
        config: a ``model_type`` (``"llama"``, ``"qwen2"``, ...) or a folder with ``config.json``.
        overrides: config attributes to set on top (``{"num_hidden_layers": 8}``).
        vocab_size: the vocabulary size; None keeps the config's.
    """
    transformers = _transformers()
    folder = Path(config).expanduser()
    settings = dict(overrides or {})
    if vocab_size is not None:
        settings["vocab_size"] = vocab_size
    # Settings go through the config's constructor, which derives fields from them (layer_types, ...).
    if (folder / "config.json").is_file():
        cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True, **settings)
    elif config in transformers.CONFIG_MAPPING:
        cfg = transformers.AutoConfig.for_model(config, **{**TINY_SHAPE, **FAMILY_DEFAULTS.get(config, {}), **settings})
    else:
        raise ValueError(
            f"model.config={config!r} is neither a folder with a config.json nor a transformers model_type: "
            f"use a family name such as {', '.join(sorted(FAMILY_DEFAULTS))}, or a local save_pretrained folder."
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(
            f"model.config={config!r} is an encoder-decoder ({type(cfg).__name__}): pick a decoder-only model."
        )
    return cfg


class HFCausalLM(pl.LightningModule):
    """A ``transformers`` causal LM trained on ``{input_ids, attention_mask, labels}`` batches.

    Args:
        config: a ``model_type`` built at a tiny size (random weights), or a local folder with
            ``config.json`` (random weights of that shape).
        config_overrides: config attributes to change (``{"tie_word_embeddings": True}``).
        vocab_size: vocabulary size (128: the byte-level data folds bytes into it); None keeps the config's.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        optimizer: a partial optimizer factory taking parameter groups (Hydra ``_partial_: true``);
            AdamW(lr=3e-3) when omitted.
        weight_decay: applied to matrices only (not biases, norms or embeddings).
        warmup_steps: linear warm-up steps of the learning-rate schedule.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
    """

    def __init__(
        self,
        config: str = "llama",
        config_overrides: Optional[dict[str, Any]] = None,
        vocab_size: Optional[int] = 128,
        attn_implementation: str = "sdpa",
        optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=3e-3)
        cfg = build_config(config, dict(config_overrides or {}), vocab_size)
        self.model = _transformers().AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int = 0) -> Tensor:
        return self(batch["input_ids"], batch.get("attention_mask"))

    def configure_optimizers(self) -> Any:
        # Matrices decay; biases, norms and the token embedding do not. A tied head is the embedding under
        # another name (a pipeline stage holding only the head sees that name): it must not decay either.
        tied = self.model.config.tie_word_embeddings
        groups = weight_decay_groups(
            self, self.hparams.weight_decay, exempt=lambda name: "embed" in name or (tied and "lm_head" in name)
        )
        return with_warmup_cosine(self.optimizer_factory(groups), self.hparams.warmup_steps, self.hparams.max_steps)
