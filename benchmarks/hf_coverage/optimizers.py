"""How a cell of the coverage matrix trains: plain SGD (the original matrix) or AdamW as a fine-tune is run.

SGD at lr 0.1 for 4 steps moves each parameter by lr x its gradient, so fp32 reordering noise stays at its own
scale and anything above the tolerance is wrong. Users train with AdamW, which divides each gradient element by
its own running size: noise on a near-zero gradient becomes an update of lr size, and a run drifts by rounding
alone. The AdamW mode is the optimizer users run, at a typical fine-tune's settings; its cells beyond the
tolerance are judged against the family's floor under the same arithmetic (:mod:`.floor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch


@dataclass(frozen=True)
class Optimizer:
    """One optimizer mode of the matrix.

    Attributes:
        name: ``"sgd"`` or ``"adamw"``.
        steps: optimizer steps per cell.
        lr: the learning rate (flat: no warm-up, no decay).
        betas: AdamW's moment decays (unused by SGD).
        weight_decay: decay of the recipe's decaying group (matrices; biases, norms and embeddings never decay).
        eps: AdamW's denominator guard.
    """

    name: str
    steps: int
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8

    def factory(self) -> Callable[..., torch.optim.Optimizer]:
        """The optimizer factory the recipe's ``configure_optimizers`` calls with its parameter groups."""
        if self.name == "sgd":
            return partial(torch.optim.SGD, lr=self.lr)
        return partial(torch.optim.AdamW, lr=self.lr, betas=self.betas, eps=self.eps)

    def describe(self) -> str:
        """One line for pages and logs."""
        if self.name == "sgd":
            return f"{self.steps} SGD steps (lr {_number(self.lr)})"
        return (f"{self.steps} AdamW steps (lr {_number(self.lr)}, betas ({self.betas[0]:g}, {self.betas[1]:g}), "
                f"weight decay {self.weight_decay:g} on matrices, eps {_number(self.eps)})")


def _number(value: float) -> str:
    """``0.1``, ``3e-4``, ``1e-8``: the way a recipe writes a rate."""
    return f"{value:g}" if value >= 0.01 else f"{value:.0e}".replace("e-0", "e-")


#: The matrix's modes. AdamW: lr 3e-4 (the top of a fine-tune's usual 1e-5..3e-4), betas (0.9, 0.95) and weight
#: decay 0.1 as Llama's and most recent decoders' recipes, 8 steps (twice the SGD run: AdamW's first steps are
#: sign-like updates of lr size, later ones show the drift the moments accumulate).
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer("sgd", steps=4, lr=0.1),
    "adamw": Optimizer("adamw", steps=8, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
    # The recipe's own default (HFCausalLM without optimizer=: AdamW lr 3e-3, torch's betas, decay 0.1): the
    # settings of issue 43's example of a pipeline that drifted.
    "adamw_recipe": Optimizer("adamw_recipe", steps=8, lr=3e-3, weight_decay=0.1),
}


def optimizer(name: str) -> Optimizer:
    """The mode named ``name``.

    Raises:
        ValueError: an unknown name (the known ones are listed).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not a mode of the matrix: use one of {', '.join(OPTIMIZERS)}.")
    return OPTIMIZERS[name]
