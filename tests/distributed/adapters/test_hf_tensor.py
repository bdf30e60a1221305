"""Hugging Face decoders train under tensor_parallel from their own tp_plan, with no glue (issue 15).

The user's module holds ``AutoModelForCausalLM.from_config(cfg)`` as ``self.model`` and returns
``self.model(**batch).loss``: no protocol method. Three families, random init from tiny configs,
8 AdamW steps with clipping in fp32, on padded batches with ``-100`` labels:

* Llama (untied) and Qwen2 (``tie_word_embeddings=True``) under ``tensor_parallel`` tp2;
* Qwen3 under tp2: its plan's ``replicated_with_grad_allreduce`` per-head norms sum their gradients;
* Gemma2 (tied by default, eager attention) and Mistral under tp2 with ``sequence_parallel=True``
  (RMSNorms by duck type, attention called by keyword, rotary positions from the global sequence),
  Mistral also with ``loss_parallel=True`` (transformers' own loss on vocabulary-sharded logits);

every rank within 1e-5 of Lightning's one-process run. The tied pair is one DTensor parameter
after sharding (and one tensor under both state-dict keys), and a negative control shards the
tied Qwen2 the way ``parallelize_module`` alone does (untied) and shows its loss drifting.
One launch of 2 ranks runs every tensor-parallel case; one 1-process launch gives the references.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_parallel.testing import max_abs_difference, run_processes
from lightning_parallel.testing.fit import fit_recording_losses

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

STEPS, BATCH, SEQ, VOCAB, TOLERANCE = 8, 4, 16, 128, 1e-5
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# name -> (family, config overrides, strategy options)
CASES = {
    "llama/tp2": ("llama", {"tie_word_embeddings": False}, {}),
    "qwen2-tied/tp2": ("qwen2", {"tie_word_embeddings": True}, {}),
    "gemma2-tied/tp2+sp": ("gemma2", {"tie_word_embeddings": True}, {"sequence_parallel": True}),
    "qwen3/tp2": ("qwen3", {"tie_word_embeddings": False}, {}),  # per-head q/k norms: gradients summed over ranks
    "mistral/tp2+sp+lp": (
        "mistral", {"tie_word_embeddings": False}, {"sequence_parallel": True, "loss_parallel": True}
    ),
}


class UserModule(pl.LightningModule):
    """What a user writes: the HF model as a submodule, its own loss, no protocol method."""

    def __init__(self, family: str, overrides: dict) -> None:
        super().__init__()
        import transformers

        config = transformers.AutoConfig.for_model(family, **SHAPE, **overrides)
        torch.manual_seed(0)
        attention = "eager" if family == "gemma2" else "sdpa"  # Gemma2 has no sdpa path
        self.model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def padded_samples(count: int = STEPS * BATCH) -> list[dict[str, torch.Tensor]]:
    """Token windows, some padded at the end (mask 0, label -100), fixed by the seed."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(count):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        valid = SEQ - (i % 3) * 4  # 16, 12 or 8 valid tokens
        mask = (torch.arange(SEQ) < valid).long()
        ids = ids.masked_fill(mask == 0, SHAPE["pad_token_id"])
        samples.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))
    return samples


def _strategy(options: dict) -> Any:
    from lightning_parallel.strategies import TensorParallelStrategy

    return TensorParallelStrategy(tensor_parallel_size=2, **options)


def fit_case(name: str, world_size: int) -> tuple[list[float], UserModule]:
    family, overrides, options = CASES[name]
    pl.seed_everything(0)
    module = UserModule(family, overrides)
    strategy = _strategy(options) if world_size > 1 else "auto"
    losses = fit_recording_losses(module, strategy, world_size, padded_samples(), BATCH, STEPS, gradient_clip_val=0.5)
    return losses, module


def references(rank: int, world_size: int) -> dict[str, list[float]]:
    """Lightning's one-process losses of every case."""
    return {name: fit_case(name, 1)[0] for name in CASES}


def tie_facts(module: UserModule) -> dict[str, Any]:
    """Whether the tied embedding and head are one sharded parameter, and one tensor in the state dict."""
    from torch.distributed.tensor import DTensor

    model = module.model
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    state = module.state_dict()
    head_key, embed_key = "model.lm_head.weight", "model.model.embed_tokens.weight"
    return dict(
        same_parameter=head is embed,
        sharded=isinstance(head, DTensor) and str(head.placements) == "(Shard(dim=0),)",
        parameters=len(list(module.parameters())),
        state_dict_shares_storage=state[head_key].to_local().data_ptr() == state[embed_key].to_local().data_ptr(),
    )


def untied_control(rank: int) -> list[float]:
    """Negative control: the tied Qwen2 sharded as ``parallelize_module`` alone leaves it (untied), raw loop.

    Returns the per-step |loss difference| to the same raw loop on the unsharded model.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_parallel.parallel.grad_norm_clipping import clip_grad_norm_
    from lightning_parallel.adapters import adapt
    from lightning_parallel.parallel.tensor.plan import concrete_plan

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    reference = UserModule("qwen2", {"tie_word_embeddings": True})
    sharded = copy.deepcopy(reference)
    for name, style in concrete_plan(sharded, adapter=adapt(sharded)).items():  # the old behaviour: no re-tie
        parallelize_module(sharded.get_submodule(name), mesh, style)
    assert sharded.model.lm_head.weight is not sharded.model.model.embed_tokens.weight
    runs = []
    for module, clip in ((reference, torch.nn.utils.clip_grad_norm_), (sharded, clip_grad_norm_)):
        optimizer, losses = torch.optim.AdamW(module.parameters(), lr=1e-2), []
        for start in range(0, STEPS * BATCH, BATCH):
            batch = torch.utils.data.default_collate(padded_samples()[start:start + BATCH])
            optimizer.zero_grad()
            loss = module.training_step(batch, 0)
            loss.backward()
            clip(module.parameters(), 0.5)
            optimizer.step()
            losses.append(float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
        runs.append(losses)
    return [abs(a - b) for a, b in zip(*runs)]


def tensor_parallel_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every tp2 case through the Trainer, the tie facts of the tied ones, and the negative control."""
    out: dict[str, Any] = {"losses": {}, "ties": {}}
    for name in CASES:
        losses, module = fit_case(name, world_size)
        out["losses"][name] = losses
        if CASES[name][1].get("tie_word_embeddings"):
            out["ties"][name] = tie_facts(module)
    out["untied_control"] = untied_control(rank)
    return out


@pytest.fixture(scope="module")
def runs():
    reference = run_processes(references, 1, timeout=600)[0]
    return reference, run_processes(tensor_parallel_cases, 2, timeout=900)


def test_every_family_matches_one_process_on_every_rank(runs):
    reference, per_rank = runs
    worst = {}
    for name in CASES:
        diffs = [max_abs_difference(result["losses"][name], reference[name]) for result in per_rank]
        worst[name] = max(diffs)
        assert worst[name] < TOLERANCE, f"{name}: max |loss difference| per rank {diffs}"
        assert per_rank[0]["losses"][name] == per_rank[1]["losses"][name], name
    print("max |loss difference| vs one process:", worst)


def test_tied_embedding_and_head_stay_one_parameter(runs):
    _, per_rank = runs
    one_process = {name: len(list(UserModule(*CASES[name][:2]).parameters())) for name in CASES if "tied" in name}
    for result in per_rank:
        for name, facts in result["ties"].items():
            assert facts["same_parameter"] and facts["sharded"], (name, facts)
            assert facts["state_dict_shares_storage"], (name, facts)
            assert facts["parameters"] == one_process[name], (name, facts, one_process[name])


def test_negative_control_untied_head_drifts(runs):
    _, per_rank = runs
    for result in per_rank:
        drift = result["untied_control"]
        assert drift[0] < TOLERANCE  # the first forward is still the same model
        assert max(drift) > 100 * TOLERANCE, drift
    print("untied control: per-step |loss difference|", per_rank[0]["untied_control"])
