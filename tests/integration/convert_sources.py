"""Checkpoints of every kind the suite and its documented commands write, made for real, and what they hold.

``lp-train`` writes the Lightning single file (``strategy=single``; Lightning DDP for the README's
first look), the suite's DCP folder (``strategy=hybrid``) and DeepSpeed folders (``strategy=deepspeed``,
ZeRO 0 and 2); Lightning's own ``ModelParallelStrategy`` writes a Lightning DCP folder (no ``lp-train``
config uses it). Every model has weight-decay param groups (two per optimizer) and OmegaConf
hyper-parameters, the two things ``lp-convert`` once refused.

:func:`ground_truth` reads a source as (weights, optimizer state by parameter name) with the param
groups named by the module's own ``configure_optimizers``, independently of the inference that
``lp-convert`` runs on the positions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_parallel.checkpoints.dcp import METADATA_FILE
from lightning_parallel.checkpoints.deepspeed.folder import consolidate_state_dict, read_lightning_state
from lightning_parallel.checkpoints.deepspeed.optimizer import consolidate_optimizer_state
from lightning_parallel.checkpoints.detect import identify_writer, read_lightning_checkpoint
from lightning_parallel.checkpoints.lightning.groups import module_group_names
from lightning_parallel.checkpoints.lightning.reader import flatten_optimizer_state, load_single_file
from lightning_parallel.checkpoints.safe_loading import load_plain, plain_containers
from tests.integration.forked_cli import forked_or_spawned

HF_CLASS = "lightning_parallel.examples.nlp.hf_causal_lm.HFCausalLM"
GPT_CLASS = "lightning_parallel.examples.nlp.model.GPT"
_RUN = ["trainer=cpu_test", "trainer.max_steps=2", "trainer.val_check_interval=2", "data.max_val_batches=1",
        "data.seq_len=32", "data.batch_size=2", "data.max_bytes=50000", "logger=none",
        "callbacks.evaluation.latency_batches=1"]
_HF = ["model=hf_causal_lm", "data=text_padded", *_RUN]
# name -> (lp-train overrides, the LightningModule class); "model_parallel" is made by model_parallel_source.
LP_TRAIN = {
    "single": ([*_HF, "strategy=single"], HF_CLASS),
    "ddp_first_look": ([*_RUN, "model=gpt_moe", "model.d_model=32", "model.n_layer=2", "trainer.devices=2"], GPT_CLASS),
    "hybrid": ([*_HF, "strategy=hybrid", "trainer.devices=2", "strategy.tensor_parallel_size=1",
                "strategy.microbatches=2"], HF_CLASS),
    "zero0": ([*_HF, "strategy=deepspeed", "strategy.zero_stage=0", "trainer.devices=2"], HF_CLASS),
    "zero2": ([*_HF, "strategy=deepspeed", "strategy.zero_stage=2", "trainer.devices=2"], HF_CLASS),
}
MP_CLASS = "tests.integration.convert_sources.TinyLlamaModule"
# The tiny Llama of the Lightning ModelParallelStrategy source (its config.json is written beside it).
LLAMA = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}


def lp_train(name: str, root: Path, timeout: float = 600) -> Path:
    """Run ``lp-train`` for source ``name`` in ``root/name``; returns its ``checkpoints/last.ckpt``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    args = [*LP_TRAIN[name][0], f"hydra.run.dir={root / name}"]
    result = forked_or_spawned("lightning_parallel.cli.train", [*args], root, env, timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return root / name / "checkpoints" / "last.ckpt"


class TinyLlamaModule(pl.LightningModule):
    """A Hugging Face Llama as a user of Lightning's ModelParallelStrategy writes it: FSDP2 per layer over data."""

    def __init__(self, settings: Any, weight_decay: float = 0.1) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()  # settings arrive as an OmegaConf DictConfig, as Hydra hands them over
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**dict(settings)))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # the root is what training_step calls: its hooks gather the rest

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def train_dataloader(self) -> Any:
        tokens = torch.randint(0, LLAMA["vocab_size"], (16, 16), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(tokens, batch_size=2)

    def configure_optimizers(self) -> Any:
        from lightning_parallel.examples.optimization import weight_decay_groups

        groups = weight_decay_groups(self, self.hparams.weight_decay, exempt=lambda name: "embed" in name)
        return torch.optim.AdamW(groups, lr=1e-3)


def model_parallel_source(rank: int, world_size: int, root: str) -> None:
    """Rank function: ``ModelParallelStrategy`` (data 2) fits :class:`TinyLlamaModule` 2 steps, saves ``mp.ckpt``."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from omegaconf import OmegaConf

    from lightning_parallel.testing.fit import quiet_trainer

    trainer = quiet_trainer(world_size, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2, [])
    trainer.fit(TinyLlamaModule(OmegaConf.create(LLAMA)))
    trainer.save_checkpoint(str(Path(root) / "mp.ckpt"))


def group_names(path: Path, class_path: str) -> list[list[list[str]]]:
    """The param groups' names as the module's configure_optimizers builds them (on the meta device)."""
    writer = identify_writer(path)
    if writer == "deepspeed":
        meta = read_lightning_state(path)
    else:
        meta = load_single_file(path) if writer == "lightning-single-file" else load_plain(path / METADATA_FILE)
    return module_group_names(class_path, plain_containers(dict(meta["hyper_parameters"])), meta.get("hparams_name"))


def ground_truth(path: Path, class_path: Optional[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A source's weights and its optimizer state by name (the suite's flattened keys), groups named by the module."""
    writer = identify_writer(path)
    if writer == "deepspeed":
        groups = group_names(path, class_path)[0]
        optimizer = consolidate_optimizer_state(path, None, groups)
        return dict(consolidate_state_dict(path)), flatten_optimizer_state(optimizer)
    names = group_names(path, class_path) if writer == "lightning-single-file" else None
    checkpoint = read_lightning_checkpoint(path, names)  # DCP folders hold the state by name
    return dict(checkpoint["state_dict"]), checkpoint["optimizer_states"][0]
