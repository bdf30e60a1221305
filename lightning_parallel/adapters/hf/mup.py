"""μP for the Hugging Face decoders whose shapes the suite knows: Llama-style dense decoders (:data:`MUP_FAMILIES`).

Every parameter of such a model has a μP role by its name (:func:`hf_mup_role`): ``embed_tokens`` is the input,
``lm_head`` the output, the decoder layers' ``q/k/v/o_proj`` and ``gate/up/down_proj`` weights are hidden (both
dimensions grow with ``hidden_size``; the head count stays), norms and biases are vectors. :func:`apply_hf_mup`
puts μP's forward in place (each attention's ``scaling`` at ``1 / d_head``, the logits x ``base_width / width``
through a forward hook on the output embedding, which every layout keeps: the pipeline's head stage calls the same
module, tensor parallelism wraps it in place) and records the base width in the config (``mup_base_width``), from
where the adapter's initialiser scales the hidden weights' std (:func:`scale_hidden_init`) on every path that
initialises the model (built with storage, or on ``meta`` and materialised per rank).

Note:
    A model family outside :data:`MUP_FAMILIES` is refused (Gemma scales its embeddings by ``sqrt(hidden_size)``,
    Granite and MiniCPM carry their own multipliers, mixtures of experts have routers whose width rule is not built);
    so is a known family holding a matrix that none of the names above covers.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parallel.mup import MupWidth, full_ndim

#: ``config.model_type``\ s whose every parameter :func:`hf_mup_role` names.
MUP_FAMILIES = ("llama", "mistral", "qwen2")
#: Where the base width is kept: the config (``save_pretrained`` writes it; transformers ignores it).
CONFIG_KEY = "mup_base_width"

_HIDDEN = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
_INPUT = re.compile(r"(^|\.)embed_tokens\.weight$")
_OUTPUT = re.compile(r"(^|\.)lm_head\.weight$")


def hf_mup_role(name: str, param: Tensor) -> str:
    """A known decoder's parameter ``name`` to μP (:data:`lightning_parallel.mup.ROLES`), under any prefix.

    Args:
        name: the parameter's name (``model.model.layers.0.self_attn.q_proj.weight``).
        param: the parameter (its full dimensions count).

    Raises:
        ValueError: a matrix none of the known names covers.
    """
    if _INPUT.search(name):
        return "input"
    if _OUTPUT.search(name):
        return "output"
    if _HIDDEN.search(name):
        return "hidden"
    if full_ndim(param) <= 1:
        return "vector"
    raise ValueError(f"μP knows no role for {name} (a {full_ndim(param)}-D parameter): the decoders it knows hold "
                     "embed_tokens, lm_head, q/k/v/o_proj, gate/up/down_proj, norms and biases only. Use a "
                     f"model of {', '.join(MUP_FAMILIES)} (model.config=llama), or leave μP out "
                     "(drop scaling=mup and model.base_width).")


def check_hf_mup_config(config: Any, base_width: Optional[int] = None) -> None:
    """Refuse a config whose family :func:`hf_mup_role` does not know (before the model is built).

    Args:
        config: the ``transformers`` config.
        base_width: the base width asked for (for the message).

    Raises:
        ValueError: ``config.model_type`` outside :data:`MUP_FAMILIES`, naming the fix.
    """
    family = getattr(config, "model_type", None)
    if family not in MUP_FAMILIES:
        raise ValueError(
            f"base_width={base_width} (μP) knows the shapes of {', '.join(MUP_FAMILIES)} decoders, not "
            f"{type(config).__name__} (model_type {family!r}): use model.config=llama (or qwen2, mistral), or leave "
            "μP out (drop scaling=mup and model.base_width).")


def hf_mup_width(model: nn.Module) -> Optional[MupWidth]:
    """The model's width against the base width its config records (None: no μP)."""
    config = getattr(model, "config", None)
    base = getattr(config, CONFIG_KEY, None)
    return MupWidth(int(config.hidden_size), int(base)) if base is not None else None


class OutputMultiplier:
    """A forward hook multiplying a module's output by ``value`` (μP's logits x ``base_width / width``).

    Args:
        value: the multiplier.
    """

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
        return output * self.value

    def __repr__(self) -> str:
        return f"OutputMultiplier({self.value:g})"


def _attentions(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "scaling", None), float)]


def apply_hf_mup(model: nn.Module, base_width: int) -> MupWidth:
    """Make a known decoder a μP model of base width ``base_width`` (module docstring). Call it once, right after
    building the model (on ``meta`` or with storage), before the strategy splits it.

    Args:
        model: the ``transformers`` causal LM.
        base_width: the ``hidden_size`` the learning rate was tuned at.

    Raises:
        ValueError: a family or a parameter μP does not know, or attention modules that do not match the layers.
    """
    config = model.config
    check_hf_mup_config(config, base_width)
    for name, param in model.named_parameters():
        hf_mup_role(name, param)
    width = MupWidth(int(config.hidden_size), base_width)
    attentions = _attentions(model)
    if len(attentions) != config.num_hidden_layers:
        raise ValueError(f"{type(model).__name__}: found {len(attentions)} attention modules with a float 'scaling' "
                         f"for {config.num_hidden_layers} layers; μP cannot set 1/d_head on each. Leave μP out "
                         "(drop scaling=mup and model.base_width).")
    for attention in attentions:
        attention.scaling = width.attention_scale(int(attention.head_dim))
    model.get_output_embeddings().register_forward_hook(OutputMultiplier(width.output_multiplier))
    setattr(config, CONFIG_KEY, base_width)
    return width


def scale_hidden_init(model: nn.Module, name: str, module: nn.Module) -> None:
    """After the model's own initialiser ran on ``module``: a hidden weight's std x ``sqrt(base_width / width)``.

    Args:
        model: the ``transformers`` model.
        name: the module's name inside ``model``.
        module: the module (or its copy) just initialised.
    """
    width = hf_mup_width(model)
    weight = getattr(module, "weight", None)
    if width is None or not isinstance(weight, Tensor) or not _HIDDEN.search(f"{name}.weight"):
        return
    with torch.no_grad():
        weight.mul_(width.hidden_init_factor)
