"""μP's arithmetic for Adam-family optimizers: what ``width / base_width`` changes, and nothing else.

Note:
    The rules are written relative to the base model (the ``mup`` package's formulation, Tensor Programs V
    Table 3), so at ``width == base_width`` every factor is 1 and the model is exactly its standard
    parametrisation: the run the learning rate was tuned on. With ``m = width / base_width``:

    * hidden weights (both dimensions grow with the width: attention and MLP matrices): init std x ``m**-0.5``
      (variance 1 / fan_in), lr x ``1 / m``, and weight decay x ``m`` so that AdamW's decoupled decay per step
      (``lr x weight_decay``) stays what it was at the base width (the ``mup`` package's ``MuAdamW`` does the same);
    * input weights (embeddings), vectors (norms, biases) and the output head's weight: base init, base lr;
    * the logits: x ``1 / m`` (the head's multiplier; its weight keeps the base init, as ``MuReadout`` after
      ``set_base_shapes``);
    * attention scores: ``1 / d_head`` instead of ``1 / sqrt(d_head)``, written ``d_head**-0.5 / sqrt(m)``:
      the base model's scale times ``sqrt(base_d_head / d_head)``, which is ``sqrt(d_head_at_base) / d_head`` when
      the width grows by widening the heads (their count fixed, as the GPT recipe and the Hugging Face configs do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: What a parameter is to μP: ``input`` (embeddings), ``hidden`` (matrices whose two dimensions grow with the
#: width), ``output`` (the head's weight), ``vector`` (norms, biases: one dimension grows).
ROLES = ("input", "hidden", "output", "vector")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (a model width, e.g. {name}=64).")
    return value


@dataclass(frozen=True)
class MupWidth:
    """A model's width against the width its hyperparameters were tuned at (module docstring: the rules).

    Args:
        width: the model's width (the GPT recipe's ``d_model``, a Hugging Face config's ``hidden_size``).
        base_width: the width the learning rate and initialisation were tuned at (``model.base_width``).

    Raises:
        ValueError: a width that is not a positive integer (the message names ``model.base_width``).
    """

    width: int
    base_width: int

    def __post_init__(self) -> None:
        _positive("model.base_width", self.base_width)
        _positive("width", self.width)

    @property
    def multiplier(self) -> float:
        """``width / base_width``."""
        return self.width / self.base_width

    @property
    def hidden_lr_factor(self) -> float:
        """The hidden weights' lr over the base lr: ``base_width / width``."""
        return self.base_width / self.width

    @property
    def hidden_init_factor(self) -> float:
        """The hidden weights' init std over the base std: ``sqrt(base_width / width)``."""
        return math.sqrt(self.base_width / self.width)

    @property
    def output_multiplier(self) -> float:
        """What the logits are multiplied by: ``base_width / width``."""
        return self.base_width / self.width

    def attention_scale(self, head_dim: int) -> float:
        """The attention scores' scale: ``head_dim**-0.5 / sqrt(width / base_width)`` (``1 / d_head`` up to the base
        model's constant; module docstring).

        Args:
            head_dim: the model's head dimension.
        """
        return head_dim**-0.5 / math.sqrt(self.multiplier)

    def describe(self) -> str:
        """One line for the start-up table and messages."""
        return (f"width {self.width} / base {self.base_width} = x{self.multiplier:g}: hidden matrices lr "
                f"x{self.hidden_lr_factor:.4g} and init std x{self.hidden_init_factor:.4g}, logits "
                f"x{self.output_multiplier:.4g}, attention 1/d_head")
