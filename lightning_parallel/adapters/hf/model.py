"""Finding a Hugging Face ``transformers`` model inside a LightningModule, and its causal-LM loss terms.

``transformers`` is optional: nothing here imports it unless the user already did (a
module cannot hold a ``PreTrainedModel`` otherwise), so the suite's import cost and its
dependencies do not grow for users without it.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy ignore_index for padding and masked prompts


def _pretrained_class() -> Optional[type]:
    # transformers.modeling_utils, not the package: torchmetrics imports the (lazy) package in every run, and asking it
    # for PreTrainedModel loaded modeling_utils, its quantizers and torchao (1-3 s) in runs that hold no HF model. A
    # module holding a PreTrainedModel has loaded modeling_utils already.
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel`` (False when transformers was never imported)."""
    cls = _pretrained_class()
    return cls is not None and isinstance(module, cls)


def find_hf_model(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The outermost Hugging Face model in ``module`` and its attribute path (``""`` when ``module`` is one).

    Args:
        module: a LightningModule or any ``nn.Module``.

    Returns:
        ``(prefix, model)`` such that ``module.get_submodule(prefix) is model``, or None when
        ``module`` holds no ``PreTrainedModel``.

    Raises:
        ValueError: ``module`` holds two unrelated Hugging Face models (for example a
            policy and a reference model): the suite cannot tell which one to split.
    """
    if _pretrained_class() is None:
        return None
    if is_hf_model(module):
        return "", module
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if is_hf_model(sub) and not any(name.startswith(prefix + ".") for prefix, _ in found):
            found.append((name, sub))
    if len(found) > 1:
        names = ", ".join(f"{n} ({type(m).__name__})" for n, m in found)
        raise ValueError(
            f"{type(module).__name__} holds several Hugging Face models ({names}); the suite splits one model. "
            "Define the protocol methods (pipeline_layers, tensor_parallel_plan, ...) "
            "on the LightningModule to say how."
        )
    return found[0] if found else None


def causal_lm_valid_count(labels: Tensor) -> Tensor:
    """Number of tokens that carry a loss in a causal-LM batch (labels shift left by one; ``-100`` is ignored)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def causal_lm_loss_terms(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of token losses, number of valid tokens)`` with transformers' ``ForCausalLMLoss`` conventions.

    The mean over a global batch is ``sum(sums) / sum(counts)`` over its micro-batches and
    data-parallel ranks -- not the mean of per-micro-batch means, which is wrong whenever
    the valid-token counts differ (padding, prompt masking).

    Args:
        logits: ``(batch, seq, vocab)`` model output (upcast to fp32 as transformers does).
        labels: ``(batch, seq)`` token ids with ``-100`` where no loss is taken (not yet shifted).
    """
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    total = nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return total, (shifted != IGNORE_INDEX).sum().to(torch.int64)
