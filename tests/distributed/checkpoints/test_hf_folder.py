"""Hugging Face folders in and out under pp2 x tp2 (issue 15): a ``save_pretrained`` folder loaded by
:class:`~lightning_parallel.callbacks.HuggingFaceWeights` (each rank reading its slices) trains with the losses of one
process that loaded it with ``from_pretrained``; the trained checkpoint exported with ``lp-convert --to hf`` loads
with ``from_pretrained`` and gives the one-process trained model's logits. Llama (untied) and Qwen2 (tied embeddings).
"""

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from examples.nlp.hf_causal_lm import HFCausalLM
from examples.nlp.hf_data import PaddedTextDataModule
from lightning_parallel.callbacks import HuggingFaceWeights
from lightning_parallel.cli.convert import main as lp_convert
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

FAMILIES = ("llama", "qwen2")  # qwen2: tie_word_embeddings=True
GLOBAL_BATCH, SEQ_LEN, STEPS, TOLERANCE = 8, 32, 4, 1e-5
PROBE = torch.arange(2 * SEQ_LEN).reshape(2, SEQ_LEN) % 120 + 3  # fixed token ids for the logits comparison


def _module(family, seed, folder=None):
    torch.manual_seed(seed)
    # No weight decay: the recipe exempts the tied embedding by name, which misses the LM head's copy on the last
    # pipeline stage (a recipe issue, reported separately, not what this test is about).
    module = HFCausalLM(family, optimizer=partial(torch.optim.AdamW, lr=1e-2), weight_decay=0.0)
    if folder is not None:  # the one-process reference: the user's from_pretrained
        module.model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    return module


def _fit(world_size, strategy, module, callbacks=()):
    history = LossHistory()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, gradient_clip_val=0.5, callbacks=[history, *callbacks])
    trainer.fit(module, datamodule=PaddedTextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, max_bytes=40_000))
    return history.losses, trainer


def _reference(rank, world_size, root):
    """Writes each family's pretrained folder, then trains what from_pretrained loads from it (one process)."""
    out = {}
    for family in FAMILIES:
        folder = Path(root) / f"{family}-pretrained"
        _module(family, seed=0).build().model.save_pretrained(folder)
        module = _module(family, seed=5, folder=folder)
        losses, _ = _fit(1, "auto", module)
        with torch.no_grad():
            out[family] = (losses, module.model(input_ids=PROBE).logits)
    return out


def _parallel(rank, world_size, root):
    """pp2 x tp2 from a differently seeded module: the callback must replace every weight with the folder's."""
    out = {}
    for family in FAMILIES:
        loader = HuggingFaceWeights(Path(root) / f"{family}-pretrained")
        strategy = Hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=4)
        losses, trainer = _fit(world_size, strategy, _module(family, seed=7), [loader])
        trainer.save_checkpoint(Path(root) / f"{family}-pp2xtp2.ckpt")
        out[family] = (losses, loader.report)
    out["dp2xtp2-zero3"] = _loaded_under_fsdp(world_size, Path(root) / "llama-pretrained")
    return out


class _CompareAndStop(pl.Callback):
    """Right after HuggingFaceWeights: every parameter, gathered whole, against the folder; then stops the run."""

    def __init__(self, folder):
        self.folder = folder

    def on_fit_start(self, trainer, module):
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor

        stored = load_file(self.folder / "model.safetensors")
        worst, placements = 0.0, set()
        for name, param in module.named_parameters():
            if isinstance(param, DTensor):
                placements.add(str(param.placements))
            full = param.full_tensor() if isinstance(param, DTensor) else param
            worst = max(worst, (full.detach() - stored[name[len("model."):]]).abs().max().item())
        raise _Stop(worst, placements)


class _Stop(Exception):
    pass


def _loaded_under_fsdp(world_size, folder):
    """FSDP2 over tensor parallelism: strided shards (read whole, kept local) next to plain row/column shards."""
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Hybrid(tensor_parallel_size=2, zero_stage=3),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
                         callbacks=[HuggingFaceWeights(folder), _CompareAndStop(folder)])
    try:
        trainer.fit(
            _module("llama", seed=7), datamodule=PaddedTextDataModule(seq_len=SEQ_LEN, batch_size=4, max_bytes=40_000)
        )
    except _Stop as stop:
        return stop.args
    raise AssertionError("the comparison did not run")


def test_a_pretrained_folder_trains_under_pp2_x_tp2_and_exports_back_to_a_folder(tmp_path):
    (reference,) = run_processes(_reference, 1, str(tmp_path), timeout=900)
    parallel = run_processes(_parallel, 4, str(tmp_path), timeout=900)
    for family in FAMILIES:
        losses, logits = reference[family]
        for rank, result in enumerate(parallel):
            got, report = result[family]
            first, every = abs(got[0] - losses[0]), max_abs_difference(got, losses)
            print(f"{family} rank {rank}: first-step |loss diff| {first:.2e}, {STEPS} steps {every:.2e}, read {report}")
            assert first < TOLERANCE, (family, rank, got, losses)
            assert every < TOLERANCE, (family, rank, got, losses)
        _check_export(tmp_path, family, logits)
    for rank, result in enumerate(parallel):
        worst, placements = result["dp2xtp2-zero3"]
        print(f"llama dp2 x tp2 ZeRO-3 rank {rank}: max |loaded - folder| {worst:.1e}, placements {sorted(placements)}")
        assert worst == 0.0 and any("StridedShard" in p for p in placements)


def _check_export(root, family, logits):
    """lp-convert --to hf of the pp2 x tp2 checkpoint: from_pretrained gives the trained model's logits."""
    from safetensors import safe_open

    from lightning_parallel.checkpoints.pt import consolidate

    saved, exported = root / f"{family}-pp2xtp2.ckpt", root / f"{family}-hf"
    meta = torch.load(saved / "meta.pt", weights_only=True)
    extra = [] if "hugging_face" in meta else ["--hf-config", str(root / f"{family}-pretrained")]
    assert lp_convert([str(saved), str(exported), "--to", "hf", *extra]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        diff = (model(input_ids=PROBE).logits - logits).abs().max().item()
    scale = max(1.0, logits.abs().max().item())  # fp32 rounding in the logits grows with their magnitude
    print(f"{family}: exported logits vs one-process trained model {diff:.2e} (largest logit {scale:.1f}; "
          f"recorded model: {not extra})")
    # Single logits after 4 AdamW steps at lr 1e-2 carry the layouts' fp32 rounding amplified (qwen2: 1.2e-4 of a
    # largest logit 1.4, with every step's loss within 1e-6): the training parity is the losses' check above, and
    # the export is the checkpoint bit for bit (below); this bound only catches a wrong or partial export.
    assert diff < 2e-4 * scale
    trained = {k[len("model."):]: v for k, v in consolidate(saved).items()}
    for name, value in model.state_dict().items():  # the export is the checkpoint, bit for bit
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    with safe_open(str(exported / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert not any(k.startswith("model.model.") for k in keys)  # no LightningModule prefix
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in keys) != tied and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
