"""A small Vision Transformer written to be split: pipeline stages and tensor shards.

Note:
    * The model is ``patch_embed -> blocks -> head``; those are the pipeline layers, and the
      blocks live in an ``nn.ModuleDict`` keyed ``"0".."N-1"`` so parameter names
      (``blocks.2.attn.q.weight``) do not change with the pipeline split.
    * Patches are cut with ``F.unfold`` and projected by a ``Linear`` (the same map as a
      stride-``patch_size`` convolution) so the patch projection is a plain matrix.
    * The head mean-pools the tokens instead of reading a class token: one tensor in,
      one out per layer, and no extra token to keep on the first pipeline stage.
    * The blocks are :class:`examples.transformer.Block` with bidirectional attention (the
      GPT recipe uses the same block, causal).
    * The layers are created in ``configure_model()`` (:mod:`examples.building`): on the ``meta``
      device under the suite's strategies, so each rank allocates only its share. Linear weights are
      truncated N(0, 0.02), biases zero, the position table N(0, 0.02), each through its module's own
      ``reset_parameters()``; ``ViT(...).build()`` creates them without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..building import BuildsInConfigureModel, NormalLinear, seed_built_model
from ..optimization import weight_decay_groups, with_warmup_cosine
from ..transformer import Block

STD = 0.02  # Linear weights: truncated N(0, STD), biases zero; the position table: N(0, STD)
linear = partial(NormalLinear, std=STD, truncated=True)


class PatchEmbedding(nn.Module):
    """Cut an image into square patches, project each to ``d_model``, add a learned position.

    Args:
        image_size: height and width of the (square) input images.
        patch_size: side of a patch; must divide ``image_size``.
        in_channels: image channels (1 for grey, 3 for RGB).
        d_model: token width.
        dropout: dropout after the position is added.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = linear(in_channels * patch_size * patch_size, d_model)
        self.pos = nn.Parameter(torch.empty(1, (image_size // patch_size) ** 2, d_model))
        self.drop = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The position table, the one tensor this module holds itself (``proj`` initialises its own)."""
        nn.init.normal_(self.pos, std=STD)

    def forward(self, images: Tensor) -> Tensor:
        # (B, C, H, W) -> (B, C*p*p, N) -> (B, N, C*p*p): one row per patch.
        patches = F.unfold(images, kernel_size=self.patch_size, stride=self.patch_size).transpose(1, 2)
        return self.drop(self.proj(patches) + self.pos)


class ClassifierHead(nn.Module):
    """Final norm, mean over tokens, projection to class logits."""

    def __init__(self, d_model: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.proj = linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x).mean(dim=1))


class ViT(BuildsInConfigureModel, pl.LightningModule):
    """A small Vision Transformer classifier following the suite's module protocol.

    Batches are ``(images, labels)``: images ``(B, C, H, W)`` floats, labels ``(B,)`` class ids.

    Args:
        image_size: side of the square input images (8 for scikit-learn's digits).
        patch_size: side of a patch (must divide ``image_size``).
        in_channels: image channels.
        num_classes: classes to predict.
        d_model: token width.
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``d_model``).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout probability everywhere.
        label_smoothing: cross-entropy label smoothing.
        optimizer: a partial optimizer factory taking parameter groups (Hydra ``_partial_: true``);
            AdamW(lr=1e-3) when omitted.
        weight_decay: applied to matrices only (not biases, norms or the position table).
        warmup_steps: linear warm-up steps of the learning-rate schedule.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
    """

    def __init__(
        self,
        image_size: int = 8,
        patch_size: int = 2,
        in_channels: int = 1,
        num_classes: int = 10,
        d_model: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        mlp_ratio: int = 2,
        dropout: float = 0.0,
        label_smoothing: float = 0.0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        weight_decay: float = 0.05,
        warmup_steps: int = 0,
        max_steps: int = 0,
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(
                f"n_head={n_head} must divide d_model={d_model}: pick n_head among the divisors of d_model."
            )
        if image_size % patch_size:
            raise ValueError(
                f"patch_size={patch_size} must divide image_size={image_size}: pick a divisor, or resize the images "
                "(data.image_size)."
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=1e-3)

    def configure_model(self) -> None:
        """Create the layers (once): on ``meta`` under the suite's strategies, else with storage and the
        seeded initial values every layout gives them."""
        if hasattr(self, "blocks"):
            return  # fit then test with one Trainer, or build() first: built once
        hp = self.hparams
        self.patch_embed = PatchEmbedding(hp.image_size, hp.patch_size, hp.in_channels, hp.d_model, hp.dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(hp.d_model, hp.n_head, hp.mlp_ratio, hp.dropout, causal=False, linear=linear)
             for i in range(hp.n_layer)}
        )
        self.head = ClassifierHead(hp.d_model, hp.num_classes)
        seed_built_model(self)

    # --- module protocol -------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        return [self.patch_embed, *self.blocks.values(), self.head]

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output, target, label_smoothing=self.hparams.label_smoothing)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Megatron-style sharding of each block: q/k/v and MLP-up by columns (heads / hidden
        units), attention-out and MLP-down by rows (one all-reduce each).

        The patch embedding and the head stay replicated: they are a few thousand parameters
        and the head's class count (10) would not divide most tensor sizes. ``gather_input``
        makes the block's input one DTensor shared by q/k/v, so its gradient is reduced once.
        """
        return {
            "blocks.*.attn": "gather_input",
            "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise",
            "blocks.*.attn.out": "rowwise",
            "blocks.*.mlp": "gather_input",
            "blocks.*.mlp.up": "colwise",
            "blocks.*.mlp.down": "rowwise",
        }

    # --- evaluation (lightning_parallel.callbacks.EvaluationReport) -------------------
    def evaluation_metrics(self) -> dict[str, Any]:
        """Fresh torchmetrics, updated with ``(logits, labels)`` of whole evaluation sets."""
        from torchmetrics.classification import MulticlassAccuracy

        return {"accuracy": MulticlassAccuracy(num_classes=self.hparams.num_classes, average="micro")}

    # --- Lightning -------------------------------------------------------------------
    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)

    def _step(self, batch: tuple[Tensor, Tensor], name: str) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.pipeline_loss(logits, labels)
        sync = name != "train"
        self.log(f"{name}_loss", loss, prog_bar=name != "test", sync_dist=sync)
        if name != "train":
            accuracy = (logits.argmax(-1) == labels).float().mean()
            self.log(f"{name}_accuracy", accuracy, prog_bar=name == "val", sync_dist=sync)
        return loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(images)

    def configure_optimizers(self) -> Any:
        # Matrices decay; biases, norms and the position table do not.
        groups = weight_decay_groups(self, self.hparams.weight_decay, exempt=lambda name: name.endswith("pos"))
        return with_warmup_cosine(self.optimizer_factory(groups), self.hparams.warmup_steps, self.hparams.max_steps)
