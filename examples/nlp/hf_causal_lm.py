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
    * ``pretrained`` is a local ``save_pretrained`` folder: its config, and its weights, which
      :class:`PretrainedWeights` (the suite's ``HuggingFaceWeights``) loads after the strategy split
      the model, each rank reading only its slices of the safetensors files.
    * The model is created in ``configure_model()`` (:mod:`examples.building`): on the ``meta`` device
      under the suite's strategies, so each rank allocates only its share; built with storage (Lightning's
      own strategies, ``build()``), it gets the seeded values every layout gives it, or the folder's weights.
    * ``transformers`` is the optional extra ``hf`` and is imported only when the model is built.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_parallel.adapters.hf.mup import CONFIG_KEY, apply_hf_mup, check_hf_mup_config, hf_mup_role, hf_mup_width
from lightning_parallel.callbacks.hf_weights import HuggingFaceWeights
from lightning_parallel.mup import check_mup_optimizer, mup_optimizer

from ..building import BuildsInConfigureModel, seed_built_model, zero3_partitioned
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


def model_config(
    config: str, overrides: Optional[dict[str, Any]], vocab_size: Optional[int], pretrained: Optional[str]
) -> Any:
    """The recipe's ``transformers`` config: :func:`build_config`, or the ``pretrained`` folder's own.

    With ``pretrained`` the vocabulary is the folder's; ``vocab_size`` then only bounds the ids the data
    produces (``data=text_padded`` folds bytes into it) and must not exceed that vocabulary.

    Raises:
        ValueError: ``pretrained`` holds no ``config.json``, or its vocabulary is smaller than ``vocab_size``.
    """
    if pretrained is None:
        return build_config(config, overrides, vocab_size)
    folder = Path(str(pretrained)).expanduser()
    if not (folder / "config.json").is_file():
        raise ValueError(f"model.pretrained={pretrained!r} holds no config.json: give a local folder written by "
                         "save_pretrained (config.json and model.safetensors).")
    cfg = build_config(str(folder), overrides)
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise ValueError(f"The data folds bytes into model.vocab_size={vocab_size} ids, but {str(folder)!r} has a "
                         f"vocabulary of {cfg.vocab_size}: set model.vocab_size={cfg.vocab_size} or less.")
    return cfg


def check_mup_settings(cfg: Any, base_width: Optional[int], pretrained: Optional[str]) -> None:
    """``base_width`` (μP) against the config: a family μP knows, and the base width a folder's config records.

    Raises:
        ValueError: a family :mod:`lightning_parallel.adapters.hf.mup` does not know; a config recording another
            base width (or one, without ``base_width``); μP on a folder's weights trained without it.
    """
    recorded = getattr(cfg, CONFIG_KEY, None)
    if recorded is not None and recorded != base_width:
        raise ValueError(f"The model's config records μP's {CONFIG_KEY}={recorded}: set model.base_width={recorded} "
                         "with scaling=mup (its weights expect μP's multipliers).")
    if base_width is None:
        return
    check_hf_mup_config(cfg, base_width)
    if pretrained is not None and recorded is None:
        raise ValueError(f"base_width={base_width} (μP) with model.pretrained: the folder's weights were trained "
                         "without μP's multipliers, which would change what they compute. Drop model.base_width.")


def _zero_init_open() -> bool:
    """Whether a ``deepspeed.zero.Init`` context is open (Lightning opens one around configure_model under ZeRO-3)."""
    return bool(getattr(sys.modules.get("deepspeed.runtime.zero.partition_parameters"), "zero_init_context", 0))


def _all_on_meta(model: nn.Module) -> nn.Module:
    """A model built on ``meta`` whose constructor made some tensors with storage anyway (DiffLlama draws its
    ``lambda_*`` with ``torch.normal(..., size=...)``, which ignores the default device) gets those on ``meta`` too:
    the strategy materialises and initialises every tensor of its share (``_init_weights`` covers them), and
    refuses a model holding both kinds. A model built with storage is returned as it is."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
        return model
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta:
                setattr(module, name, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta:
                setattr(module, name, buffer.to("meta"))
    return model


def new_model(cfg: Any, attn_implementation: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config``; inside ``deepspeed.zero.Init`` without transformers' own initialisation.

    ZeRO-3 partitions each submodule's parameters as it is created, so the initialisation transformers runs on the
    whole model at the end would meet empty slices: it is skipped (the weights are tied again), and the caller
    initialises or loads each module gathered (:func:`examples.building.seed_built_model`, :func:`load_pretrained`).
    """
    transformers = _transformers()
    if not _zero_init_open():
        return _all_on_meta(transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation))
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    model.tie_weights()
    return model


def load_pretrained(module: nn.Module, folder: str, prefix: str = "model.") -> None:
    """Fill a model built with storage from a ``save_pretrained`` folder, before any engine copies its weights.

    Plain tensors: :func:`lightning_parallel.checkpoints.hf.load.load_hf_weights` (named errors for missing
    or extra keys). Parameters DeepSpeed ZeRO-3 partitioned as they were created: gathered one at a time.
    """
    from lightning_parallel.checkpoints.hf.load import load_hf_weights, tied_keys, weight_files

    if not zero3_partitioned(module):
        load_hf_weights(module, Path(folder), prefix)
        return
    import deepspeed
    from safetensors import safe_open

    files, tied = weight_files(Path(folder)), tied_keys(module, prefix)
    for name, param in module.named_parameters():
        key = name[len(prefix):]
        stored = key if key in files else tied.get(key, key)
        if stored not in files:
            raise ValueError(f"{folder!r} holds no {key!r}: the folder holds another architecture.")
        with safe_open(str(files[stored]), framework="pt") as handle:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                param.data.copy_(handle.get_tensor(stored))


class PretrainedWeights(HuggingFaceWeights):
    """``HuggingFaceWeights`` for :class:`HFCausalLM`: skipped when ``configure_model`` already loaded the folder
    (a model built with storage, under Lightning's own strategies or DeepSpeed, is filled before the engine
    copies its weights; a model built on ``meta`` is filled here, each rank reading only its slices)."""

    def _wanted(self, pl_module: pl.LightningModule) -> bool:
        return not getattr(pl_module, "pretrained_loaded", False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wanted(pl_module):
            super().on_fit_start(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wanted(pl_module):
            super().on_validation_start(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wanted(pl_module):
            super().on_test_start(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._wanted(pl_module):
            super().on_predict_start(trainer, pl_module)


class HFCausalLM(BuildsInConfigureModel, pl.LightningModule):
    """A ``transformers`` causal LM trained on ``{input_ids, attention_mask, labels}`` batches.

    Args:
        config: a ``model_type`` built at a tiny size (random weights), or a local folder with
            ``config.json`` (random weights of that shape).
        config_overrides: config attributes to change (``{"tie_word_embeddings": True}``).
        vocab_size: vocabulary size (128: the byte-level data folds bytes into it); None keeps the config's.
            With ``pretrained`` the folder's vocabulary is kept and this only bounds the data's ids.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        optimizer: a partial optimizer factory taking parameter groups (Hydra ``_partial_: true``);
            AdamW(lr=3e-3) when omitted.
        weight_decay: applied to matrices only (not biases, norms or embeddings).
        warmup_steps: linear warm-up steps of the learning-rate schedule.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
        pretrained: a local ``save_pretrained`` folder to start from (its config and weights; ``config`` is
            then not used), or None for random weights.
        base_width: μP (``scaling=mup``): the ``hidden_size`` the learning rate was tuned at (the head count stays
            as the width grows); :mod:`lightning_parallel.adapters.hf.mup` for the families it knows. None: the
            standard parametrisation.
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
        pretrained: Optional[str] = None,
        base_width: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=3e-3)
        self.model_config = model_config(config, dict(config_overrides or {}), vocab_size, pretrained)
        check_mup_settings(self.model_config, base_width, pretrained)
        if base_width is not None:
            check_mup_optimizer(self.optimizer_factory)
        # Training keeps no key/value cache: with one, transformers would not separate the documents of packed rows
        # (position ids restarting, data=hf_text), and the suite's context-parallel split follows what it does.
        self.model_config.use_cache = False
        # Import the model's class now: defined inside deepspeed.zero.Init (configure_model under ZeRO-3), a class
        # would lose the __init__ wrappers transformers' kernels put on it when the context restores its classes.
        causal_lms = _transformers().MODEL_FOR_CAUSAL_LM_MAPPING
        if type(self.model_config) not in causal_lms:
            raise ValueError(f"{type(self.model_config).__name__} has no causal LM in transformers: pick a "
                             "decoder-only family (llama, qwen2, mistral, ...).")
        causal_lms[type(self.model_config)]
        self.pretrained_loaded = False

    def configure_model(self) -> None:
        """Create the model (once): on ``meta`` under the suite's strategies (:class:`PretrainedWeights` fills it
        after the split), else with storage: the folder's weights, or the seeded values every layout gives it."""
        if hasattr(self, "model"):
            return  # fit then test with one Trainer, or build() first: built once
        self.model = new_model(self.model_config, self.hparams.attn_implementation)
        if self.hparams.get("base_width") is not None:  # before the initialisation below reads it
            apply_hf_mup(self.model, self.hparams.base_width)
        folder = self.hparams.get("pretrained")
        if folder is None:
            seed_built_model(self)
        elif not any(p.is_meta for p in self.model.parameters()):
            load_pretrained(self, str(folder))
            self.pretrained_loaded = True

    def configure_callbacks(self) -> list[pl.Callback]:
        """The folder's weights after the strategy split the model (``pretrained`` only)."""
        folder = self.hparams.get("pretrained")
        return [] if folder is None else [PretrainedWeights(str(folder))]

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
        tied = getattr(self.model.config, "tie_word_embeddings", False)  # not every config has it (Inkling)
        groups = weight_decay_groups(
            self, self.hparams.weight_decay, exempt=lambda name: "embed" in name or (tied and "lm_head" in name)
        )
        width = hf_mup_width(self.model)  # μP: the hidden matrices in groups of their own at lr x base / width
        optimizer = (mup_optimizer(self.optimizer_factory, groups, self, hf_mup_role, width) if width
                     else self.optimizer_factory(groups))
        return with_warmup_cosine(optimizer, self.hparams.warmup_steps, self.hparams.max_steps)
