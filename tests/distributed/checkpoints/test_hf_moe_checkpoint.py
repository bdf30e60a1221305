"""A Hugging Face MoE model trained under expert parallelism: its checkpoint resumes under another expert size, and
``lp-convert --to hf`` writes what the family's ``save_pretrained`` writes (one key per expert in transformers 5.25),
which ``from_pretrained`` loads into its grouped experts (issue 31).

Mixtral and Qwen3-MoE (4 experts, top 2, the router balancing loss in the objective), right-padded batches, AdamW,
clipping. Saved after 4 steps under data 2 x expert 2 (each rank holds 2 experts as ``Shard(0)`` slices of
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, under their unsplit names); resumed under data 4 x
expert 4 (one expert per rank) for steps 5-8 with the losses of one process that never stopped; exported to a
``save_pretrained`` folder whose model gives the logits of the one process's model after the same 4 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_parallel.cli.convert import main as lp_convert  # noqa: E402
from lightning_parallel.strategies import HybridParallelStrategy as Hybrid  # noqa: E402
from lightning_parallel.testing import LossHistory, max_abs_difference, run_processes  # noqa: E402
from lightning_parallel.testing.fit import quiet_trainer  # noqa: E402
from lightning_parallel.testing.models import FixedOrderData  # noqa: E402
from tests.distributed.adapters.test_hf_expert_parity import (  # noqa: E402
    CLIP,
    EXPERTS,
    GLOBAL_BATCH,
    MoELM,
    right_padded_samples,
)

pytestmark = pytest.mark.slow

FAMILIES = ("mixtral+router", "qwen3_moe+router")
HALF, TOL = 4, 1e-5
PROBE = torch.arange(2 * 16).reshape(2, 16) % 60 + 3


def _fit(world_size: int, strategy, family: str, steps: int, ckpt_path=None):
    import lightning.pytorch as pl

    pl.seed_everything(0)
    history = LossHistory()
    trainer = quiet_trainer(world_size, strategy, steps, [history], **CLIP)
    data_parallel = getattr(strategy, "options", None)
    per_rank = GLOBAL_BATCH // (data_parallel.data_parallel_size if data_parallel is not None else 1)
    module = MoELM(family)
    # 32 samples, 8 per step: the checkpoint after 4 steps lies on an epoch boundary (the loader is not resumable)
    samples = right_padded_samples()[: HALF * GLOBAL_BATCH]
    trainer.fit(module, datamodule=FixedOrderData(samples, batch_size=per_rank), ckpt_path=ckpt_path)
    return history.losses, trainer, module


def _one_process(rank: int, world_size: int) -> dict:
    out = {}
    for family in FAMILIES:
        losses, _, _ = _fit(1, "auto", family, 2 * HALF)
        _, _, module = _fit(1, "auto", family, HALF)
        with torch.no_grad():
            out[family] = (losses, module.model(input_ids=PROBE).logits)
    return out


def _save(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for family in FAMILIES:
        losses, trainer, module = _fit(world_size, Hybrid(data_parallel_size=2, expert_parallel_size=2), family,
                                       HALF)
        trainer.save_checkpoint(Path(root) / f"{family}.ckpt")
        experts = module.model.model.layers[0].mlp.experts
        out[family] = (losses, tuple(experts.gate_up_proj.to_local().shape))
    return out


def _resume(rank: int, world_size: int, root: str) -> dict:
    strategy = lambda: Hybrid(data_parallel_size=4, expert_parallel_size=4)  # noqa: E731
    return {family: _fit(world_size, strategy(), family, 2 * HALF, ckpt_path=str(Path(root) / f"{family}.ckpt"))[0]
            for family in FAMILIES}


def test_saved_under_expert_2_resumes_under_expert_4_and_exports_a_folder_from_pretrained_loads(tmp_path):
    reference = run_processes(_one_process, 1, timeout=600)[0]
    saved = run_processes(_save, 2, str(tmp_path), timeout=600)
    resumed = run_processes(_resume, 4, str(tmp_path), timeout=900)
    for family in FAMILIES:
        losses, logits = reference[family]
        for rank, result in enumerate(saved):
            assert result[family][1][0] == EXPERTS // 2  # two experts on each rank
            assert max_abs_difference(result[family][0], losses[:HALF]) < TOL, (family, rank)
        for rank, result in enumerate(resumed):
            diff = max_abs_difference(result[family], losses[HALF:])
            assert len(result[family]) == HALF and diff < TOL, f"{family} resumed on rank {rank}: {diff:.2e}"
        exported = tmp_path / f"{family}-hf"
        assert lp_convert([str(tmp_path / f"{family}.ckpt"), str(exported), "--to", "hf"]) == 0
        model = transformers.AutoModelForCausalLM.from_pretrained(exported)
        assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape)[0] == EXPERTS  # the family's layout
        with torch.no_grad():
            diff = (model(input_ids=PROBE).logits - logits).abs().max().item()
        print(f"{family}: exported logits max |diff| {diff:.2e}")
        assert diff < 1e-4 * max(1.0, logits.abs().max().item())
