"""DLRM on TorchRec: ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection`` fed ``KeyedJaggedTensor`` s.

The recipe for recommenders at their real scale, where the tables do not fit one process: under
``strategy=torchrec`` TorchRec shards the collection's tables over the ranks (table-wise, column-wise, ...) and
the dense part (bottom MLP, interaction, top MLP) is data-parallel. The model code is TorchRec's own and does not
change with the plan. The small nn.Embedding DLRM of :mod:`examples.recsys.model` stays for the suite's tensor
strategy.

Note:
    * Tables are updated inside backward by an optimizer of their own (``table_optimizer``, TorchRec's fused
      kernels when sharded; torch's optimizer-in-backward hooks on one process): the classic DLRM recipe
      (Adagrad-family for tables, a dense optimizer for the MLPs). ``configure_optimizers`` therefore gives the
      dense optimizer the MLPs only.
    * ``configure_model`` builds on whatever device the strategy chooses (``meta`` under ``strategy=torchrec``,
      which allocates only each rank's shards). Built with storage (Lightning's own strategies, ``build()``), the
      dense layers get the suite's seeded per-layer values and the tables the same values TorchRec's shards get
      (:func:`lightning_parallel.adapters.torchrec.init_tables`), so every layout starts equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_parallel.adapters.torchrec import apply_table_optimizer, in_backward_parameters, init_tables

from ..building import BuildsInConfigureModel, seed_built_model
from .torchrec_data import feature_names, table_names


def interaction_arch(num_sparse_features: int) -> torch.nn.Module:
    """TorchRec's ``InteractionArch`` with a ``reset_parameters()`` that refills its index buffer.

    Built on ``meta`` its ``triu_indices`` buffer has no values; the suite materialises a module by calling its
    ``reset_parameters()`` (:mod:`examples.building`), so this one recomputes the indices there.
    """
    from torchrec.models.dlrm import InteractionArch

    class Interaction(InteractionArch):
        def reset_parameters(self) -> None:
            self.triu_indices.copy_(torch.triu_indices(self.F + 1, self.F + 1, offset=1))

    return Interaction(num_sparse_features)


class TorchRecDLRM(BuildsInConfigureModel, pl.LightningModule):
    """DLRM (Naumov et al., 2019) on TorchRec's modules, for click-through prediction.

    Batches are ``(dense (B, D) float, KeyedJaggedTensor with keys f_0.., label (B,) int64)``; the loss is binary
    cross-entropy of one logit per sample.

    Args:
        num_dense: dense features per sample.
        table_sizes: rows of each categorical feature's table (tables ``t_j`` read features ``f_j``).
        embedding_dim: width of every table (and the bottom MLP's output).
        bottom_widths: hidden widths of the bottom MLP (dense features -> ``embedding_dim``).
        top_widths: hidden widths of the top MLP (interaction -> 1 logit).
        optimizer: a partial optimizer factory for the dense parameters (Hydra ``_partial_: true``);
            Adam(lr=1e-3) when omitted.
        table_optimizer: the tables' optimizer in backward: ``sgd``, ``adagrad``, ``adam`` or ``rowwise_adagrad``.
        table_lr: its learning rate.
    """

    def __init__(
        self,
        num_dense: int = 4,
        table_sizes: Sequence[int] = (4096, 2048, 32, 32, 24),
        embedding_dim: int = 16,
        bottom_widths: Sequence[int] = (64,),
        top_widths: Sequence[int] = (64, 32),
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        table_optimizer: str = "adagrad",
        table_lr: float = 0.05,
    ) -> None:
        super().__init__()
        table_sizes = [int(s) for s in table_sizes]
        if not table_sizes or min(table_sizes) < 1:
            raise ValueError(f"table_sizes={table_sizes} must list at least one table of >= 1 rows.")
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.Adam, lr=1e-3)

    def configure_model(self) -> None:
        """Create the layers (once) on the current default device: ``meta`` under ``strategy=torchrec``."""
        if hasattr(self, "dlrm"):
            return
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.models.dlrm import DLRM

        hp = self.hparams
        tables = [
            EmbeddingBagConfig(name=name, embedding_dim=hp.embedding_dim, num_embeddings=rows, feature_names=[key])
            for name, key, rows in zip(table_names(len(hp.table_sizes)), feature_names(len(hp.table_sizes)),
                                       hp.table_sizes)
        ]
        # EmbeddingBagCollection ignores the device context unless told: pass the context's device explicitly.
        collection = EmbeddingBagCollection(tables=tables, device=torch.get_default_device())
        self.dlrm = DLRM(
            embedding_bag_collection=collection,
            dense_in_features=hp.num_dense,
            dense_arch_layer_sizes=[*hp.bottom_widths, hp.embedding_dim],
            over_arch_layer_sizes=[*hp.top_widths, 1],
        )
        self.dlrm.inter_arch = interaction_arch(len(tables))
        apply_table_optimizer(self, hp.table_optimizer, {"lr": hp.table_lr})
        if seed_built_model(self):  # with storage: the values every layout gives it
            init_tables(self, torch.initial_seed())

    def forward(self, dense: Tensor, sparse: Any) -> Tensor:
        return self.dlrm(dense_features=dense, sparse_features=sparse).squeeze(-1)

    # --- module protocol (lightning_parallel.protocol; EvaluationReport uses it) ---------
    def pipeline_split_batch(self, batch: Sequence[Any]) -> tuple[tuple[Tensor, Any], Tensor]:
        dense, sparse, labels = batch
        return (dense, sparse), labels

    def evaluation_metrics(self) -> dict[str, Any]:
        """Fresh torchmetrics, updated with ``(logits, labels)`` of whole evaluation sets."""
        from torchmetrics.classification import BinaryAUROC

        return {"auc": BinaryAUROC()}

    # --- Lightning -------------------------------------------------------------------
    def predict_step(self, batch: Sequence[Any], batch_idx: int = 0) -> Tensor:
        (dense, sparse), _ = self.pipeline_split_batch(batch)
        return self(dense, sparse)

    def _step(self, batch: Sequence[Any], name: str) -> Tensor:
        (dense, sparse), labels = self.pipeline_split_batch(batch)
        loss = F.binary_cross_entropy_with_logits(self(dense, sparse), labels.to(dense.dtype))
        # The mean over the data-parallel ranks (one all-reduce per step): the loss of the global batch, the same
        # at any world size, where rank 0's own batch alone would change with it.
        self.log(f"{name}_loss", loss, prog_bar=name != "test", sync_dist=True, batch_size=len(labels))
        return loss

    def training_step(self, batch: Sequence[Any], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Sequence[Any], batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        tables = {id(p) for p in in_backward_parameters(self).values()}
        return self.optimizer_factory([p for p in self.parameters() if id(p) not in tables])
