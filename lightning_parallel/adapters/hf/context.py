"""Context parallelism for a Hugging Face causal LM, with no glue in the user's module.

The user's ``training_step`` returns ``self.model(**batch).loss`` on dict batches of whole sequences
(``input_ids``, ``attention_mask``, ``labels``, optionally ``position_ids``). Under context parallelism:

* :func:`apply_hf_context` registers an attention function under a name unique to the run through
  transformers' public registry (``AttentionInterface.register``) and switches the model to it
  (``set_attn_implementation``). The function (:func:`context_attention_function`) hands each layer's
  query, key and value shares to the ring or all-to-all kernel
  (:func:`~lightning_parallel.parallel.context.context_attention`), with the layer's causal flag,
  sliding window, scale and soft-cap;
* the strategy splits every batch (:func:`split_hf_batch`): each rank keeps its head-tail share of
  ``input_ids``, ``labels`` and the position ids (the global positions, for the rotary angles), gets
  ``shift_labels`` -- its share of the labels shifted over the *whole* sequence, which transformers'
  ``ForCausalLMLoss`` takes as they are -- and an ``attention_mask`` that is a *descriptor* of the whole
  sequence's documents (:func:`descriptor`);
* the descriptor is a 4-D int64 tensor, which transformers' mask builders pass through unchanged, and
  the run's attention name is not one they know, so they build no mask of their own: the descriptor
  reaches every attention call, which turns it into an
  :class:`~lightning_parallel.parallel.context.AttentionMask` over global positions.

Note:
    What is masked follows what transformers does in one process (``masking_utils``): with a 2-D
    ``attention_mask`` only its padding (packed position ids are then ignored); without one, the
    documents of position ids that restart -- but only when the forward runs without a key/value
    cache (``use_cache=False`` or gradient checkpointing), since transformers skips packing detection
    otherwise; without either, one document per row. A query at a padding position sees no key (output
    0, as flash attention gives): transformers' eager and sdpa kernels give such a row different values
    (they disagree with each other), which matters only where a padding position's prediction carries
    a loss -- a left-padded row's first token when its label is kept.

Note:
    Mistakes are refused, not trained on: a forward that did not receive the split batch's mask (the
    user rebuilt the batch) raises in the first attention layer, and one with ``labels`` but no
    ``shift_labels`` raises before it runs -- transformers would otherwise shift each rank's share on
    its own and lose or misplace the prediction at every chunk boundary.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_parallel import _compat
from lightning_parallel.adapters.hf.model import IGNORE_INDEX
from lightning_parallel.parallel.context.plan import ContextGroup, SequenceSplit

# Config keys of a dropout probability outside attention (StarCoder2's residual_dropout, GPT-NeoX's hidden_dropout,
# Phi's resid_pdrop, embedding dropouts); classifier and summary heads are not part of a causal LM's forward.
_DROPOUT = re.compile(r"dropout|pdrop")

#: Layer types whose attention the context kernels compute (``config.layer_types``).
ATTENTION_TYPES = ("full_attention", "sliding_attention")
NAME_PREFIX = "lightning_parallel_context"
CALL_HINT = (
    "call the model with the batch the strategy split, unchanged: self.model(**batch) (add keyword arguments, "
    "but do not rebuild input_ids, attention_mask or labels from parts of it)"
)
# Attention arguments the context kernels cannot apply; a model passing any of them is refused.
_UNSUPPORTED_ARGUMENTS = {"s_aux": "attention sinks", "position_bias": "an additive position bias",
                          "attention_bias": "an additive attention bias"}


def _refuse(cls: str, why: str, fix: str) -> ValueError:
    return ValueError(
        f"context_parallel_size > 1, but {cls} {why}. {fix}, set context_parallel_size=1, or define "
        "context_parallel_plan() on the LightningModule to say how its attention splits (docs/context-parallel.md)."
    )


def check_hf_context(model: nn.Module, method: str, size: int, tensor_size: int = 1) -> None:
    """Refuse, before any process starts, a Hugging Face model whose attention cannot be split along the sequence.

    Works on the meta device (reads the class and its config only).

    Args:
        model: the ``transformers`` model.
        method: ``"ring"`` or ``"ulysses"``.
        size: the context-parallel size.
        tensor_size: the tensor-parallel size (it splits the heads before Ulysses does).

    Raises:
        ValueError: naming what is missing and the way out.
    """
    from lightning_parallel.adapters.hf.loss import is_causal_lm
    from lightning_parallel.parallel.context import METHODS, check_heads

    cls, config = type(model).__name__, model.config
    if method not in METHODS:
        raise ValueError(f"context_parallel_method={method!r} is not one of {METHODS}: use 'ring' or 'ulysses'.")
    if getattr(config, "is_encoder_decoder", False) or not is_causal_lm(model):
        raise _refuse(cls, "is not a decoder-only causal LM (its loss is not transformers' ForCausalLMLoss)",
                      "Use a *ForCausalLM model")
    if not _compat.can_set_attention_implementation(model):
        raise _refuse(cls, "does not call its attention through transformers' AttentionInterface, so its attention "
                      "cannot be replaced", "Use a model family that does (Llama, Qwen2, Mistral, Gemma, ...)")
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        raise _refuse(cls, "is configured for bidirectional attention", "Keep the model causal")
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_TYPES))
    if kinds:
        raise _refuse(cls, f"has layers of types {kinds} (only {list(ATTENTION_TYPES)} are split along the sequence; "
                      "a recurrent or chunked layer would see only this rank's share)", "Use a model without them")
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] == "sinks"]
    if sinks:
        raise _refuse(cls, f"has attention sinks ({sinks[0]}, ...), which the context kernels do not compute",
                      "Use a model without sinks")
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    if dropout > 0:
        raise _refuse(cls, f"has config.attention_dropout={dropout}: attention computed across ranks has no dropout "
                      "(one process's random mask could not be reproduced)", "Set config.attention_dropout=0")
    _check_other_dropout(cls, config)
    heads = getattr(config, "num_attention_heads", None)
    if method == "ulysses" and heads:
        check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, size, tensor_size)


def _check_other_dropout(cls: str, config: Any) -> None:
    """Refuse dropout outside attention: each context rank would draw its share's mask from the same seed."""
    others = {key: value for key, value in config.to_dict().items() if _DROPOUT.search(key)
              and not key.startswith(("classifier", "summary")) and key != "attention_dropout"
              and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0}
    if others:
        raise _refuse(cls, f"has dropout outside attention ({', '.join(f'config.{k}={v}' for k, v in others.items())}): "
                      "each context rank would draw its mask for its share of the sequence from the same seed, "
                      "neither one process's mask nor independent along the sequence",
                      f"Set {' and '.join(f'config.{k}=0' for k in others)} for context parallelism")


# The batch ---------------------------------------------------------------------------------
def descriptor(documents: Optional[Tensor], batch: int, seq_len: int, device: Any = None) -> Tensor:
    """The ``attention_mask`` every rank passes to the model: the whole sequence's documents, 4-D int64.

    Args:
        documents: int64 ``[batch, S]`` document ids (``-1`` padding), or None when every position is
            valid and each row is one document.
        batch: the batch size.
        seq_len: the global sequence length ``S``.
        device: where to build the plain descriptor.

    Returns:
        ``documents[:, None, None, :]`` (``[batch, 1, 1, S]``), or an empty ``[batch, 0, 1, S]`` tensor for
        None: the kernels' causal fast paths need "nothing to mask" told apart without reading the data.
    """
    if documents is None:
        return torch.zeros(batch, 0, 1, seq_len, dtype=torch.int64, device=device)
    return documents.to(torch.int64)[:, None, None, :]


def read_descriptor(attention_mask: Any) -> Optional[Tensor]:
    """The ``documents`` tensor of a :func:`descriptor` (None for the plain one).

    Raises:
        ValueError: ``attention_mask`` is not a descriptor -- the model was called without the mask of the
            batch the strategy split.
    """
    is_descriptor = (isinstance(attention_mask, Tensor) and attention_mask.dim() == 4
                     and attention_mask.dtype == torch.int64 and attention_mask.shape[1] in (0, 1)
                     and attention_mask.shape[2] == 1)
    if not is_descriptor:
        got = "no attention_mask" if attention_mask is None else (
            f"an attention_mask of shape {tuple(attention_mask.shape)} and dtype {attention_mask.dtype}"
            if isinstance(attention_mask, Tensor) else f"an attention_mask of type {type(attention_mask).__name__}")
        raise ValueError(
            f"Under context parallelism each attention layer needs the mask the strategy built from the whole "
            f"sequence (a [batch, 1, 1, S] int64 descriptor in batch['attention_mask']), but it got {got}: "
            f"{CALL_HINT}."
        )
    return None if attention_mask.shape[1] == 0 else attention_mask[:, 0, 0, :]


def shifted_labels(labels: Tensor) -> Tensor:
    """The next-token targets of a whole sequence, as ``ForCausalLMLoss`` computes them: ``labels[:, 1:]`` then
    ``-100``."""
    return nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def shifted_loss_terms(logits: Tensor, shift_labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of token losses, number of valid tokens)`` of targets already shifted over the whole sequence (a
    pipeline's last stage under context parallelism; :func:`~.hf.causal_lm_loss_terms` shifts them itself)."""
    total = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return total, (shift_labels != IGNORE_INDEX).sum().to(torch.int64)


def shifted_valid_count(shift_labels: Tensor) -> Tensor:
    """Tokens carrying a loss among targets already shifted (``shift_labels`` not ``-100``)."""
    return (shift_labels != IGNORE_INDEX).sum()


def _uses_cache(model: nn.Module, batch: Mapping) -> bool:
    """Whether the forward will hold a key/value cache (transformers then skips packed-sequence detection)."""
    use_cache = batch.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", False)
    base = getattr(model, "base_model", model)
    checkpointing = getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled()
    return bool(use_cache) and not checkpointing and batch.get("cache") is None


def batch_documents(batch: Mapping, model: nn.Module) -> Optional[Tensor]:
    """The documents transformers' masks separate in one process for ``batch`` (see the module's Note)."""
    from lightning_parallel.parallel.context import documents_from

    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"Under context parallelism batch['attention_mask'] must be the 2-D padding mask [batch, S] "
                f"(1 token, 0 padding), got {shape}: the strategy builds what each attention layer needs from it."
            )
        return documents_from(mask, None)
    if positions is not None and not _uses_cache(model, batch):
        rows = batch.get("input_ids", batch.get("inputs_embeds")).shape[0]
        return documents_from(None, positions.expand(rows, -1))  # transformers expands [1, S] ids too
    return None


def split_hf_batch(batch: Any, context: ContextGroup, model: nn.Module) -> dict[str, Any]:
    """This rank's share of a dict batch of whole sequences (what :class:`SequenceSplit` calls on every batch).

    * ``input_ids``, ``labels``, ``position_ids`` and every other tensor of 2+ dimensions whose dimension 1
      is the sequence: this rank's head-tail share;
    * ``shift_labels``: the share of :func:`shifted_labels` (or of the batch's own ``shift_labels``);
    * ``position_ids`` when absent: the share of ``0..S-1``, ``[batch, S / cp]``;
    * ``attention_mask``: the :func:`descriptor` of :func:`batch_documents` over the whole sequence.

    Args:
        batch: a mapping with ``input_ids`` (or ``inputs_embeds``) ``[batch, S]``.
        context: this rank's context group.
        model: the ``transformers`` model (its config decides packing, see :func:`batch_documents`).

    Raises:
        ValueError: not a dict batch, no ``input_ids``, a mask that is not 2-D, or ``S`` not a multiple of
            ``2 x context_parallel_size``.
    """
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"Under context parallelism a Hugging Face model's batches must be dicts of whole sequences "
            f"(input_ids, attention_mask, labels, ...), got {type(batch).__name__}."
        )
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(tokens, Tensor) or tokens.dim() < 2:
        raise ValueError(f"Under context parallelism the batch needs input_ids [batch, S]; it holds {sorted(batch)}.")
    rows, seq_len = tokens.shape[:2]
    documents = batch_documents(batch, model)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "attention_mask":
            continue
        split = isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == seq_len
        out[key] = context.shard(value, 1) if split else value
    labels = batch.get("labels")
    if batch.get("shift_labels") is None and isinstance(labels, Tensor):
        out["shift_labels"] = context.shard(shifted_labels(labels), 1)
    if batch.get("position_ids") is None:
        out["position_ids"] = context.positions(seq_len, tokens.device)[None].expand(rows, -1).contiguous()
    out["attention_mask"] = descriptor(documents, rows, seq_len, tokens.device)
    return out


# The attention function --------------------------------------------------------------------
def context_attention_function(context: ContextGroup) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention function that attends across ``context`` (registered by :func:`apply_hf_context`).

    Its signature is transformers' (``sdpa_attention_forward``'s): ``(module, query, key, value,
    attention_mask, scaling, dropout, sliding_window, softcap, **kwargs)`` with query
    ``[batch, q_heads, S / cp, head_dim]`` and key/value ``[batch, kv_heads, S / cp, head_dim]``; it returns
    ``(output [batch, S / cp, q_heads, head_dim], None)``.

    Note:
        Ulysses runs the kernels' own exact attention over the whole sequence, not the model's previous
        implementation: transformers' kernels take their masks in forms of their own (additive for eager,
        boolean for sdpa, a BlockMask for flex, none for flash), repeat key/value heads by the module's
        ``num_key_value_groups`` (wrong once Ulysses has repeated them), and would lose the fused causal
        path that the default takes when nothing but causality is masked.
    """
    from lightning_parallel.parallel.context import AttentionMask, context_attention

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  scaling: Optional[float] = None, dropout: float = 0.0, sliding_window: Optional[int] = None,
                  softcap: Optional[float] = None, **kwargs: Any) -> tuple[Tensor, None]:
        documents = read_descriptor(attention_mask)
        cls = type(module).__name__
        if dropout:
            raise ValueError(f"{cls} asked for attention dropout {dropout} under context parallelism, which computes "
                             "attention across ranks without dropout: set config.attention_dropout=0.")
        for name, what in _UNSUPPORTED_ARGUMENTS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{cls} passes {name} ({what}), which context parallelism does not compute: set "
                                 "context_parallel_size=1 for this model.")
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        mask = AttentionMask(causal=causal, window=sliding_window, documents=documents)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        positions = context.positions(query.shape[2] * context.size, query.device)
        out = context_attention(context.method, query, key, value, positions, mask, context.group,
                                scale=scale, softcap=softcap)
        return out.transpose(1, 2).contiguous(), None

    return attention


def require_split_batch(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: refuse a call whose batch did not come from the split -- an ``attention_mask`` that is not
    the descriptor (transformers would drop a 2-D one silently), or ``labels`` without ``shift_labels``."""
    read_descriptor(kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            f"{type(module).__name__} got labels but no shift_labels under context parallelism: each rank holds a "
            f"share of every sequence, so the next-token targets must come from the whole sequence (the strategy "
            f"adds shift_labels to every batch). {CALL_HINT[0].upper() + CALL_HINT[1:]}."
        )


def apply_hf_context(model: nn.Module, context: ContextGroup) -> SequenceSplit:
    """Make ``model`` attend across ``context``; returns how the strategy splits its batches.

    Registers :func:`context_attention_function` under a name unique to this call, switches the model to
    it (``set_attn_implementation``) and adds :func:`require_split_batch` as a forward pre-hook.

    Args:
        model: the ``transformers`` causal LM (this rank's share, after tensor sharding).
        context: this rank's context group.

    Raises:
        ValueError: transformers did not switch the model's attention.
    """
    from transformers import AttentionInterface

    attention = context_attention_function(context)
    name = f"{NAME_PREFIX}_{context.method}_{id(attention):x}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    if _compat.attention_implementation(model) != name:
        raise ValueError(
            f"transformers kept {type(model).__name__}'s attention implementation "
            f"{_compat.attention_implementation(model)!r}: context parallelism needs its own. Set "
            "context_parallel_size=1."
        )
    model.register_forward_pre_hook(require_split_batch, with_kwargs=True)
    return SequenceSplit(context, lambda batch: split_hf_batch(batch, context, model))

