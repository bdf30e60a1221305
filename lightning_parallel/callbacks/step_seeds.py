"""Training randomness keyed by the batch's place in the run, so a resumed run draws what the whole run drew.

Note:
    Lightning checkpoints no random generator, and saving them would not be enough: between the save (at a batch's
    end) and the next training batch, an uninterrupted run makes the validation loader's iterator (which draws its
    base seed from the global generator) while a resumed one makes the training loader's; the two runs then reach the
    next batch with different generator states, and every dropout mask after a resume is another draw (seed_oss with
    dropout 0.1 resumed on the same layout: 2.1e-3 off at the first resumed step). Megatron-LM saves each rank's
    generator states and restores them at load, which has the same gap.

    Here every training batch starts from a seed derived from the run's base seed, the optimizer step and the
    batch's place in its accumulation window -- the same on every rank, as the global generator is under
    ``seed_everything``, so tensor-parallel ranks keep drawing equal masks on replicated activations. What happened
    in between (validation, a new iterator, a restart) no longer matters. The base seed is the run's
    ``torch.initial_seed()`` at its first batch (rank 0's, broadcast) and is kept in the checkpoint, so a resume
    continues the same streams whatever seed the resuming command gives.

    torch (CPU and every CUDA device), Python's ``random`` and NumPy are seeded. A DataLoader's worker processes keep
    their own streams (seeded when the epoch's iterator is made).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

__all__ = ["StepSeeds", "step_seed"]


def step_seed(base_seed: int, step: int, micro_batch: int) -> int:
    """The seed of one training batch: a hash of the run's base seed, the optimizer step and the batch's place in its
    accumulation window (independent streams for neighbouring batches, unlike ``base + step``).

    Args:
        base_seed: the run's base seed.
        step: ``trainer.global_step`` when the batch starts.
        micro_batch: the batch's index in its accumulation window (0 without accumulation).
    """
    digest = hashlib.blake2b(f"{base_seed}/{step}/{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63: every generator takes it


def _seed_everything_quietly(seed: int) -> None:
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional
        return
    numpy.random.seed(seed % 2**32)


class StepSeeds(pl.Callback):
    """Seed every training batch from the run's seed and the batch's place in the run (see the module note).

    ``lp-train`` adds it to every run. With the Python API, pass it to the Trainer of a run that is stopped and
    resumed and has randomness in its training step (dropout, stochastic depth, sampling): its resume is then exact
    on the same layout. Across layouts, dropout is equal only where each rank draws the same masks as one process
    would (see ``docs/checkpoints.md``).
    """

    def __init__(self) -> None:
        self.base_seed: Optional[int] = None
        self._step: Optional[int] = None
        self._micro_batch = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.base_seed is None:  # a fresh run (a resumed one restored it): one base on every rank
            self.base_seed = int(trainer.strategy.broadcast(torch.initial_seed()))
        step = trainer.global_step
        self._micro_batch = self._micro_batch + 1 if step == self._step else 0
        self._step = step
        _seed_everything_quietly(step_seed(self.base_seed, step, self._micro_batch))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"base_seed": self.base_seed, "step": self._step, "micro_batch": self._micro_batch}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.base_seed = state_dict.get("base_seed")
        self._step, self._micro_batch = state_dict.get("step"), int(state_dict.get("micro_batch", 0))
