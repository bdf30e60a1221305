"""A GPT-style decoder written to be split: pipeline stages and tensor shards.

Note:
    * The blocks live in an ``nn.ModuleDict`` keyed ``"0".."N-1"`` and the whole model is
      ``embed -> blocks -> head``: those are the pipeline layers, and their parameter names
      (``blocks.3.attn.q.weight``) do not change with the pipeline split, which is what
      lets a checkpoint load under another layout.
    * The blocks are :class:`examples.transformer.Block` with causal attention (the ViT
      recipe uses the same block, bidirectional).
    * The LM head is not tied to the token embedding: tying would couple the first and
      last pipeline stages.
    * The layers are created in ``configure_model()`` (:mod:`examples.building`): on the ``meta``
      device under the suite's strategies, so each rank allocates only its share. Every weight is
      N(0, 0.02) and every bias zero, through the layers' own ``reset_parameters()``; ``GPT(...).build()``
      creates them without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.mup import MupWidth, check_mup_optimizer, mup_optimizer
from lightning_parallel.optim import MuonWithAdamW, muon_groups

from ..building import BuildsInConfigureModel, NormalLinear, seed_built_model
from ..optimization import weight_decay_groups, with_warmup_cosine
from ..transformer import Block
from .gpt_parts import STD, LMHead, TokenEmbedding, TokenPositions, mup_role
from .moe import MoEFeedForward, model_balancing_loss, moe_blocks, moe_settings
from .moe_pipeline import pipeline_begin, schedule_refusal

__all__ = ["GPT", "IGNORE_INDEX", "STD", "LMHead", "TokenEmbedding", "TokenPositions", "token_mean"]

IGNORE_INDEX = -100  # targets that carry no loss (padding, masked prompts), as in torch's cross-entropy


def token_mean(total: Tensor, count: Tensor, mean: Callable[[Tensor], Tensor]) -> Tensor:
    """``total / mean(count)``, valued at the global token mean ``mean(total) / mean(count)`` (see
    ``GPT.global_token_mean``); ``mean`` averages a tensor over the ranks whose batches differ, called once on the
    count and the sum together.

    Args:
        total: this rank's token-loss sum.
        count: this rank's tokens carrying a loss.
        mean: the cross-rank mean (identity on one rank).
    """
    means = mean(torch.stack([count.float(), total.detach().float()]))
    loss = total / means[0].to(total.dtype)
    return loss + ((means[1] / means[0]).to(loss.dtype) - loss.detach())


class GPT(BuildsInConfigureModel, pl.LightningModule):
    """A small decoder-only transformer language model following the suite's module protocol.

    Args:
        vocab_size: number of token ids (256 for bytes).
        seq_len: context length (size of the position table).
        d_model: residual width.
        n_layer: number of transformer blocks.
        n_head: attention heads (must divide ``d_model``).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        dropout: dropout probability everywhere.
        optimizer: a partial optimizer factory taking the parameter groups
            (Hydra ``_partial_: true``); AdamW(lr=3e-3) when omitted.
        weight_decay: applied to matrices only (not biases, norms or embeddings).
        warmup_steps: linear warm-up steps of the learning-rate schedule.
        max_steps: steps of the cosine decay (the Trainer's ``max_steps``); 0 keeps lr flat after warm-up.
        moe: None for dense blocks; else mixture-of-experts settings (:func:`examples.nlp.moe.moe_settings`):
            ``every`` (MoE in every k-th block) and :class:`examples.nlp.moe.MoEFeedForward`'s arguments. The
            balancing loss joins the training loss over the global batch; the sigmoid router's bias is updated
            after each step.
        base_width: μP (``scaling=mup``): the ``d_model`` the learning rate was tuned at; the blocks' matrices then
            start from std x ``sqrt(base_width / d_model)`` and train at lr x ``base_width / d_model``, the logits are
            multiplied by ``base_width / d_model`` and attention scales by ``1 / d_head``
            (:mod:`lightning_parallel.mup`). None: the standard parametrisation.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        weight_decay: float = 0.1,
        warmup_steps: int = 0,
        max_steps: int = 0,
        moe: dict[str, Any] | None = None,
        base_width: int | None = None,
    ) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(
                f"n_head={n_head} must divide d_model={d_model}: pick n_head among the divisors of d_model."
            )
        if moe:
            moe_settings(moe, n_layer)  # refuse bad settings before anything is built
        if base_width is not None and moe:
            raise ValueError(f"base_width={base_width} (μP) covers the dense GPT blocks; a router's width rule is not "
                             "built: drop model.moe, or leave μP out (drop scaling=mup and model.base_width).")
        self.mup = MupWidth(d_model, base_width) if base_width is not None else None
        self.save_hyperparameters(ignore=["optimizer"])
        self.optimizer_factory = optimizer or partial(torch.optim.AdamW, lr=3e-3)
        if self.mup:
            check_mup_optimizer(self.optimizer_factory)  # before any process starts (lp-train builds the model once)

    def configure_model(self) -> None:
        """Create the layers (once): on ``meta`` under the suite's strategies, else with storage and the
        seeded initial values every layout gives them."""
        if hasattr(self, "blocks"):
            return  # fit then test with one Trainer, or build() first: built once
        hp = self.hparams
        linear = partial(NormalLinear, std=STD * (self.mup.hidden_init_factor if self.mup else 1.0))
        scale = self.mup.attention_scale(hp.d_model // hp.n_head) if self.mup else None
        self.embed = TokenEmbedding(hp.vocab_size, hp.d_model, hp.seq_len, hp.dropout)
        experts, settings = moe_settings(hp.moe, hp.n_layer) if hp.get("moe") else (set(), {})
        settings = {"hidden": hp.mlp_ratio * hp.d_model, "std": STD, **settings}
        self.blocks = nn.ModuleDict(
            {str(i): Block(hp.d_model, hp.n_head, hp.mlp_ratio, hp.dropout, causal=True, linear=linear,
                           mlp=MoEFeedForward(hp.d_model, dropout=hp.dropout, linear=linear, **settings)
                           if i in experts else None, attention_scale=scale)
             for i in range(hp.n_layer)}
        )
        self.head = LMHead(hp.d_model, hp.vocab_size, self.mup.output_multiplier if self.mup else 1.0)
        seed_built_model(self)

    # --- module protocol -------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks.values(), self.head]

    def pipeline_loss_terms(self, output: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        """``(sum of token losses, tokens with a target)``; ``-100`` targets (padding, masked prompts) carry none.

        The loss of a global batch is ``sum(sums) / sum(counts)`` over its micro-batches and
        data-parallel ranks -- the single-process loss even when padding makes the counts differ.
        """
        total = F.cross_entropy(output.flatten(0, 1), target.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum")
        return total, (target != IGNORE_INDEX).sum()

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean loss over the tokens of one batch that have a target."""
        total, count = self.pipeline_loss_terms(output, target)
        return total / count

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """Megatron-style sharding: q/k/v and MLP-up by columns, attention-out and MLP-down by rows,
        the token embedding by vocabulary rows and the LM head by vocabulary columns.

        Under sequence parallelism the residual stream is sliced along the sequence: the
        token embedding stays replicated because the learned position table is added to it
        first, and ``embed`` slices the sum; norms run on the slice and attention/MLP gather
        the full sequence on entry. The ``sequence``/``scatter_output`` entries do nothing
        without sequence parallelism. Mixture-of-experts blocks keep their router and experts whole on every
        tensor rank (experts shard over the expert axis instead): the MLP entries name the dense blocks only.
        """
        moe = self.hparams.get("moe")
        sparse = moe_settings(moe, self.hparams.n_layer)[0] if moe else set()
        mlps = ["*"] if not sparse else [str(i) for i in range(self.hparams.n_layer) if i not in sparse]
        mlp_plan = {f"blocks.{i}.{name}": style for i in mlps
                    for name, style in (("mlp", "gather_input"), ("mlp.up", "colwise"), ("mlp.down", "rowwise"))}
        return {
            "embed.tok": "embedding_rowwise_replicated",
            "embed": "scatter_output",
            "blocks.*.ln1": "sequence",
            "blocks.*.attn": "gather_input",
            "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise",
            "blocks.*.attn.v": "colwise",
            "blocks.*.attn.out": "rowwise",
            "blocks.*.ln2": "sequence",
            **mlp_plan,
            "head.norm": "sequence",
            "head.proj": "colwise_gather",
        }

    def expert_parallel_plan(self) -> dict[str, str]:
        """Expert parallelism: each MoE block's grouped experts sharded over the expert ranks (empty when dense)."""
        return {"blocks.*.mlp.experts": "experts"} if self.hparams.get("moe") else {}

    def check_batch_split(self, splits: list[str]) -> None:
        """The balancing loss needs the routing of the whole step: under a pipeline schedule that runs a backward
        before the step's last forward it cannot be exact, and is refused (``examples/nlp/moe_pipeline.py``)."""
        refusal = schedule_refusal(self.hparams.get("moe") or {}, splits)
        if refusal is not None:
            raise ValueError(refusal)

    def pipeline_step_begin(self, step: Any) -> None:
        """Under a pipeline schedule: the MoE blocks put the balancing loss's gradient in place during it."""
        self._pipelined = pipeline_begin(self, step) if self.hparams.get("moe") else None

    def pipeline_step_end(self, step: Any) -> Optional[Tensor]:
        """The step's balancing loss (every stage's blocks), logged as ``training_step`` logs it on one process."""
        return self._pipelined.step_end(self, moe_blocks(self)) if self._pipelined is not None else None

    def context_parallel_plan(self) -> dict[str, str]:
        """Context parallelism: each block's attention sees the whole sequence across the context ranks, and
        the position table is indexed by the global positions of the tokens a rank holds."""
        return {"embed.positions": "positions", "blocks.*.attn.core": "attention"}

    # --- evaluation (lightning_parallel.callbacks.EvaluationReport) -------------------
    def evaluation_metrics(self) -> dict[str, Any]:
        """Fresh torchmetrics, updated with ``(logits, next-byte targets)`` of whole evaluation sets."""
        from torchmetrics.text import Perplexity

        return {"perplexity": Perplexity()}

    def evaluation_readout(
        self, predict: Callable[[Any], Tensor], prompt: str = "def main(", new_tokens: int = 64
    ) -> dict[str, str]:
        """A greedy continuation of ``prompt``, one forward per new byte.

        Every forward sees a fixed ``(1, seq_len)`` window (the prompt right-padded): the
        attention is causal, so padding after the last real byte does not change its logits,
        and one shape is what a pipeline schedule needs.

        Args:
            predict: ``predict(batch) -> logits`` running under the training strategy.
            prompt: the text to continue (bytes beyond the context are dropped from the front).
            new_tokens: bytes to generate.
        """
        seq_len = self.hparams.seq_len
        tokens = list(prompt.encode("utf-8"))[-(seq_len - 1) :]
        for _ in range(new_tokens):
            window = tokens[-seq_len:]
            ids = torch.zeros(1, seq_len, dtype=torch.long)
            ids[0, : len(window)] = torch.tensor(window)
            logits = predict((ids, ids))
            tokens.append(int(logits[0, len(window) - 1].argmax()))
        text = bytes(tokens).decode("utf-8", errors="replace")
        return {"sample": repr(text)}

    # --- Lightning -------------------------------------------------------------------
    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)

    def global_token_mean(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """This rank's batch loss, token-weighted over all ranks: its value is the global batch's token mean.

        Each data-parallel rank divides its token-loss sum by ``N / data_parallel_size`` (``N``:
        the global batch's tokens with a target); averaging the ranks' gradients, as data
        parallelism does, then gives the gradient of ``sum(token losses) / N``, the
        single-process loss, however padding splits the tokens among ranks. The mean over all
        ranks of the per-rank count is ``N / data_parallel_size`` also under tensor
        parallelism (tensor peers hold the same batch), so a strategy that names no loss group
        reduces over every rank. The
        returned value is the global mean on every rank; its gradient is this rank's share.
        """
        inputs, targets = batch
        total, count = self.pipeline_loss_terms(self(inputs), targets)
        if hasattr(total, "full_tensor"):  # a replicated DTensor under loss parallelism
            total = total.full_tensor()
        # One all-reduce for both means: the per-rank token count (the weighting) and the token-loss sum (the logged
        # value, mean_r(total_r / c) = mean_r(total_r) / c), not one for each; over the ranks whose batches differ
        # where the strategy says which (the suite's loss group, data x context: none under tensor parallelism
        # alone), else over every rank.
        strategy = self.trainer.strategy
        loss_group = getattr(strategy, "loss_group", None)
        group, size = loss_group() if callable(loss_group) else (None, strategy.world_size)
        return token_mean(total, count, lambda t: strategy.reduce(t, group=group, reduce_op="mean") if size > 1 else t)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        blocks = moe_blocks(self)
        for block in blocks:
            block.pop_routing_stats()  # left by a recomputation in the last backward (activation checkpointing)
        loss = self.global_token_mean(batch)
        self.log("train_loss", loss, prog_bar=True)
        if blocks:
            self._log_expert_load(blocks)
            aux, dropped = model_balancing_loss(self, mean=self._mean_over_ranks)
            self.log("moe_aux_loss", aux)
            self.log("moe_dropped", dropped, reduce_fx="sum", sync_dist=True)
            loss = loss + aux
        return loss

    def _log_expert_load(self, blocks: list[nn.Module]) -> None:
        """Tokens per expert of this step (over all ranks): ``moe_imbalance`` (busiest expert / mean, worst block)
        to every logger, and each block's histogram to TensorBoard."""
        loads = [self._mean_over_ranks(sum(s.counts for s in block.routing_stats).float()) for block in blocks]
        self.log("moe_imbalance", max(float(load.max() / load.mean().clamp_min(1e-9)) for load in loads))
        add_histogram = getattr(getattr(self.logger, "experiment", None), "add_histogram", None)
        if callable(add_histogram) and self.global_rank == 0:
            for index, load in enumerate(loads):
                experts = torch.arange(load.numel(), dtype=torch.float32).repeat_interleave(load.round().long().cpu())
                add_histogram(f"moe/block{index}/tokens_per_expert", experts, self.global_step)

    def _mean_over_ranks(self, tensor: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if getattr(self, "_pipelined", None) is not None:
            return  # a pipeline step updated the bias over its stage's data ranks (pipeline_step_end)
        for block in moe_blocks(self):
            if block.router_kind == "sigmoid":
                block.update_expert_bias(mean=self._mean_over_ranks)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.global_token_mean(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.global_token_mean(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
        idx = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(idx)

    def configure_optimizers(self) -> Any:
        if getattr(self.optimizer_factory, "func", self.optimizer_factory) is MuonWithAdamW:
            # Muon on the blocks' matrices (experts' too); AdamW on the embedding, the head, norms and biases.
            groups = muon_groups(self, self.hparams.weight_decay,
                                 exclude=lambda name: "embed" in name or name.startswith("head.") or "router" in name)
            return with_warmup_cosine(self.optimizer_factory(groups), self.hparams.warmup_steps, self.hparams.max_steps)
        # Matrices of Linear layers decay; biases, norms and embedding tables do not. Under μP the blocks' matrices
        # have groups of their own at lr x base_width / d_model.
        groups = weight_decay_groups(self, self.hparams.weight_decay, exempt=lambda name: "embed" in name)
        optimizer = (mup_optimizer(self.optimizer_factory, groups, self, mup_role, self.mup) if self.mup
                     else self.optimizer_factory(groups))
        return with_warmup_cosine(optimizer, self.hparams.warmup_steps, self.hparams.max_steps)
