"""Tiny models and data that follow the module protocol, for parity tests of every layout.

Note:
    Parity tests need the *same global batch* in every layout, in a fixed order. Lightning
    injects a shuffling ``DistributedSampler`` by default, so :class:`FixedOrderData`
    builds its own non-shuffling sampler from ``strategy.distributed_sampler_kwargs``
    (run the Trainer with ``use_distributed_sampler=False``). With data-parallel size
    ``d`` and per-rank batch ``b``, batch ``i`` of all ranks together is exactly samples
    ``[i*b*d, (i+1)*b*d)``: batch ``i`` of a single process with batch ``b*d``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.resumable_loader import resumable_loader

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adamw": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01),
}


class ResidualBlock(nn.Module):
    """``x + W2 gelu(W1 layernorm(x))``: a transformer MLP block without attention."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(pl.LightningModule):
    """A residual MLP regressor: input projection, ``depth`` blocks, output projection.

    Follows the module protocol (pipeline layers, pipeline loss, tensor-parallel plan), so
    the same module runs under single-device, DDP, DeepSpeed and the suite's strategies.

    Args:
        width: feature width (<= 64 in tests).
        depth: number of residual blocks.
        hidden: hidden width of each block (default ``2 * width``).
        optimizer: ``"sgd"`` (momentum 0.9), ``"adamw"``, or a factory taking parameters.
        seed: seed for the initial weights, so every process builds the same model.
    """

    def __init__(
        self,
        width: int = 32,
        depth: int = 4,
        hidden: int | None = None,
        optimizer: Any = "sgd",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.optimizer_choice = optimizer
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.inp = nn.Linear(width, width)
            self.blocks = nn.ModuleDict({str(i): ResidualBlock(width, hidden or 2 * width) for i in range(depth)})
            self.out = nn.Linear(width, width)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.inp, *self.blocks.values(), self.out]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        return {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.pipeline_loss(self(inputs), targets)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", self.pipeline_loss(self(inputs), targets), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("test_loss", self.pipeline_loss(self(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        factory = OPTIMIZERS[self.optimizer_choice] if isinstance(self.optimizer_choice, str) else self.optimizer_choice
        return factory(self.parameters())


class DeferredResidualMLP(ResidualMLP):
    """:class:`ResidualMLP` built in ``configure_model`` -- Lightning's recipe for models larger than a device.

    Under the suite's strategies the layers are created on the ``meta`` device and each rank allocates only
    its share; under Lightning's own strategies they are built with storage as usual.

    Args:
        width: feature width.
        depth: number of residual blocks.
        hidden: hidden width of each block (default ``2 * width``).
        optimizer: as for :class:`ResidualMLP`.
    """

    def __init__(self, width: int = 32, depth: int = 4, hidden: int | None = None, optimizer: Any = "sgd") -> None:
        pl.LightningModule.__init__(self)
        self.optimizer_choice = optimizer
        self.sizes = (width, depth, hidden or 2 * width)

    def configure_model(self) -> None:
        if hasattr(self, "inp"):
            return  # fit then test with one Trainer: built once
        width, depth, hidden = self.sizes
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleDict({str(i): ResidualBlock(width, hidden) for i in range(depth)})
        self.out = nn.Linear(width, width)


def regression_dataset(samples: int, width: int, seed: int = 0) -> TensorDataset:
    """A fixed random regression problem: targets are a smooth function of the inputs plus noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=generator)
    w = torch.randn(width, width, generator=generator) / width**0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(samples, width, generator=generator)
    return TensorDataset(x, y)


class FixedOrderData(pl.LightningDataModule):
    """Serves a dataset in a fixed order, sharded across the strategy's data-parallel ranks.

    Args:
        dataset: the samples (``(inputs, targets)`` pairs).
        batch_size: samples per data-parallel rank per step.
    """

    def __init__(self, dataset: Any, batch_size: int) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size

    def train_dataloader(self) -> DataLoader:
        # Checkpoints carry this loader's position, so mid-epoch resumes are exact.
        return resumable_loader(self.dataset, self.batch_size, trainer=self.trainer, shuffle=False)
