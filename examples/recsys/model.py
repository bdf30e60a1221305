"""A DLRM-style click-through model: embedding tables, bottom MLP, dot interaction, top MLP.

Note:
    * The parallelism that matters for a recommender is sharding its embedding tables,
      which hold almost all of its parameters. ``tensor_parallel_plan()`` shards every
      table by rows across the tensor ranks (``embedding_rowwise``): a rank stores
      ``1/t`` of each table, looks up the ids that fall in its rows, and one all-reduce
      per table sums the partial lookups. The MLPs are small and stay replicated
      (data-parallel across the data-parallel axis).
    * The forward is not a chain of single-tensor layers: the dense features (bottom MLP)
      and the categorical features (tables) are two inputs that meet in the interaction.
      So the model does not implement ``pipeline_layers()``, and a pipeline strategy
      refuses it before any process group starts, saying what is missing. Pipelining
      would not help anyway: the tables are the memory and the MLPs the (small) compute.
    * Tables live in an ``nn.ModuleDict`` keyed ``"0".."S-1"``, so parameter names
      (``embeddings.3.weight``) are the same under every layout.
    * The layers are created in ``configure_model()`` (:mod:`examples.building`): on the ``meta``
      device under the suite's strategies, so a tensor rank allocates only its rows of each table.
      Initial values come from the run's seed and the layer names (the same under every layout);
      ``DLRM(...).build()`` creates them without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..building import BuildsInConfigureModel, NormalEmbedding, seed_built_model
from ..optimization import weight_decay_groups, with_warmup_cosine


def mlp(widths: Sequence[int], last_activation: bool) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """Pairwise dot products of the feature vectors, concatenated to the dense vector.

    Input ``(B, F, D)`` (dense vector first); output ``(B, D + F(F-1)/2)``.
    """

    def forward(self, features: Tensor) -> Tensor:
        num = features.shape[1]
        dots = features @ features.transpose(1, 2)
        upper = torch.triu_indices(num, num, offset=1, device=features.device)
        return torch.cat([features[:, 0], dots[:, upper[0], upper[1]]], dim=1)


class DLRM(BuildsInConfigureModel, pl.LightningModule):
    """Deep Learning Recommendation Model (Naumov et al., 2019), small.

    Batches are ``(dense (B, D) float, sparse (B, S) int64, label (B,) int64)``; the model
    returns one click logit per sample; the loss is binary cross-entropy.

    Args:
        num_dense: dense features per sample.
        table_sizes: rows of each categorical feature's embedding table.
        embedding_dim: width of every embedding (and of the bottom MLP's output).
        bottom_widths: hidden widths of the bottom MLP (dense features -> ``embedding_dim``).
        top_widths: hidden widths of the top MLP (interaction -> 1 logit).
        optimizer: a partial optimizer factory taking parameter groups (Hydra
            ``_partial_: true``); AdamW(lr=1e-2) when omitted.
        weight_decay: applied to embedding tables and MLP matrices (not biases).
        warmup_steps: linear warm-up steps of the learning-rate schedule.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
    """

    def __init__(
        self,
        num_dense: int = 4,
        table_sizes: Sequence[int] = (4096, 2048, 32, 32, 24),
        embedding_dim: int = 16,
        bottom_widths: Sequence[int] = (64,),
        top_widths: Sequence[int] = (64, 32),
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
    ) -> None:
        super().__init__()
        table_sizes = [int(s) for s in table_sizes]
        if not table_sizes or min(table_sizes) < 1:
            raise ValueError(f"table_sizes={table_sizes} must list at least one table of >= 1 rows.")
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=1e-2)
        self.sizes = (int(num_dense), table_sizes, int(embedding_dim), list(bottom_widths), list(top_widths))

    def configure_model(self) -> None:
        """Create the layers (once): on ``meta`` under the suite's strategies, else with storage and the
        seeded initial values every layout gives them."""
        if hasattr(self, "embeddings"):
            return  # fit then test with one Trainer, or build() first: built once
        num_dense, table_sizes, dim, bottom_widths, top_widths = self.sizes
        num_features = 1 + len(table_sizes)
        # Unit-norm rows on average: dot products start O(1), so the interaction is learned from the
        # first steps (a small init sits near the saddle at 0).
        self.embeddings = nn.ModuleDict(
            {str(j): NormalEmbedding(n, dim, std=dim**-0.5) for j, n in enumerate(table_sizes)}
        )
        self.bottom = mlp([num_dense, *bottom_widths, dim], last_activation=True)
        self.interaction = DotInteraction()
        self.top = mlp([dim + num_features * (num_features - 1) // 2, *top_widths, 1], last_activation=False)
        seed_built_model(self)

    # --- module protocol -------------------------------------------------------------
    def pipeline_split_batch(self, batch: Sequence[Tensor]) -> tuple[tuple[Tensor, Tensor], Tensor]:
        dense, sparse, labels = batch
        return (dense, sparse), labels

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(output, target.to(output.dtype))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Every embedding table sharded by rows; the MLPs replicated."""
        return {"embeddings.*": "embedding_rowwise"}

    # --- evaluation (lightning_parallel.callbacks.EvaluationReport) -------------------
    def evaluation_metrics(self) -> dict[str, Any]:
        """Fresh torchmetrics, updated with ``(logits, labels)`` of whole evaluation sets."""
        from torchmetrics.classification import BinaryAUROC

        # AUC depends only on the order of the scores: logits work as well as probabilities.
        return {"auc": BinaryAUROC()}

    # --- Lightning -------------------------------------------------------------------
    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        vectors = [self.bottom(dense)] + [table(sparse[:, j]) for j, table in enumerate(self.embeddings.values())]
        return self.top(self.interaction(torch.stack(vectors, dim=1))).squeeze(-1)

    def _step(self, batch: Sequence[Tensor], name: str) -> Tensor:
        (dense, sparse), labels = self.pipeline_split_batch(batch)
        loss = self.pipeline_loss(self(dense, sparse), labels)
        self.log(f"{name}_loss", loss, prog_bar=name != "test", sync_dist=name != "train")
        return loss

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "test")

    def predict_step(self, batch: Sequence[Tensor], batch_idx: int = 0) -> Tensor:
        (dense, sparse), _ = self.pipeline_split_batch(batch)
        return self(dense, sparse)

    def configure_optimizers(self) -> Any:
        # Tables and MLP matrices decay (it keeps rarely seen rows from overfitting); biases do not.
        groups = weight_decay_groups(self, self.hparams.weight_decay)
        return with_warmup_cosine(self.optimizer_factory(groups), self.hparams.warmup_steps, self.hparams.max_steps)
