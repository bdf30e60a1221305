"""Hugging Face causal LMs pipelined from their own plan match one process (issue 15, pipeline part).

The module holds ``AutoModelForCausalLM.from_config(cfg)`` and defines no protocol method.
``parallelize`` alone (no Trainer) splits it from the model's pipeline plan and a raw loop
drives :class:`~lightning_parallel.parallel.pipeline.runner.PipelineRunner` as the pipelined executor
does: token counts all-reduced over the data axis, AdamW, clipping with the global norm
(a tied pair counted once), fp32, 8 steps. Batches are right-padded documents with masked
prompts, so valid-token counts differ between micro-batches and ranks. Every rank must report
the single-process losses (``model(**batch).loss`` on the whole global batch) within 1e-5, for
the 8 training steps and for an evaluation step after them.

Families: Llama (eager attention, untied: the mask must keep it causal and padded), Qwen2
(``tie_word_embeddings=True``: embedding on the first stage, LM head on the last) and Mistral
(a sliding window of 4 tokens, shorter than the rows, so its mask differs from the causal one).
One launch per process count: 2 processes run 1F1B and interleaved 1F1B (two stages per rank)
for Llama and Qwen2 and 1F1B for Mistral, the negative control (the old mean of
per-micro-batch means, which must miss), and the widened protocol on a user's own model (two
tensors between stages and a side input); 4 processes run data 2 x pipeline 2 with ZeRO-2.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from lightning_parallel.adapters.hf.model import causal_lm_loss_terms, causal_lm_valid_count
from lightning_parallel.layout import DATA_PARALLEL, PIPELINE_PARALLEL, ParallelLayout
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import parallelize
from lightning_parallel.parallel.grad_norm_clipping import total_grad_norm
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.parallel.pipeline.runner import PipelineRunner
from lightning_parallel.parallel.pipeline.tied import TIED_COPY_ATTR
from lightning_parallel.testing import run_processes

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

STEPS, TOL, CLIP, LR = 8, 1e-5, 0.5, 1e-2
GLOBAL_BATCH, SEQ, VOCAB = 8, 12, 64
# (family, schedule, stages per rank): the tied and the eager-attention families under both schedules
RUNS = (("llama", "1f1b", 1), ("llama", "interleaved_1f1b", 2), ("qwen2", "1f1b", 1), ("qwen2", "interleaved_1f1b", 2),
        ("mistral", "1f1b", 1))
PROTOCOL_METHODS = ("pipeline_layers", "pipeline_loss", "pipeline_loss_terms", "pipeline_split_batch",
                    "pipeline_side_inputs", "tensor_parallel_plan")


def config(family: str):
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**shape, attn_implementation="eager")
    if family == "qwen2":
        return transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    return transformers.MistralConfig(**shape, sliding_window=4)  # shorter than the rows: the window bites


class UserModule(torch.nn.Module):
    """What a user writes (minus Lightning, which the raw loop stands in for): the model, nothing else."""

    def __init__(self, family: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(config(family))

    def training_step(self, batch: dict) -> torch.Tensor:
        return self.model(**batch).loss


def batches(steps: int = STEPS) -> list[dict]:
    """Right-padded documents with a masked prompt: valid-token counts differ row by row."""
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        lengths = torch.randint(4, SEQ + 1, (GLOBAL_BATCH,), generator=generator)
        prompts = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
        positions = torch.arange(SEQ).expand(GLOBAL_BATCH, SEQ)
        mask = (positions < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill((mask == 0) | (positions < prompts[:, None]), -100)
        result.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return result


@functools.lru_cache(maxsize=None)
def reference(family: str) -> list[float]:
    """One process on the whole global batch (computed once, in the test process)."""
    module = UserModule(family)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = module.training_step(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():  # and the evaluation loss of the last batch after training
        losses.append(module.training_step(batch).item())
    return losses


def clip_tied_once(params: list, pp_group) -> None:
    """The global-norm clip with a tied pair's second copy left out of the norm (still scaled)."""
    counted = [p for p in params if not getattr(p, TIED_COPY_ATTR, False)]
    norm = total_grad_norm(counted, 2.0, pipeline_group=pp_group)
    coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)


def per_microbatch_mean(logits, labels):
    loss_sum, count = causal_lm_loss_terms(logits, labels)
    return loss_sum / count


def train(rank, layout, family, schedule, stages_per_rank, zero_stage, microbatches, mean_of_means=False) -> dict:
    options = ParallelOptions(layout.data_parallel, layout.pipeline_parallel, 1, zero_stage=zero_stage,
                              microbatches=microbatches, schedule=schedule, stages_per_rank=stages_per_rank)
    meshes = RunMeshes.build(layout, "cpu", zero_stage)
    mesh = meshes.run
    module = UserModule(family)
    assert not any(hasattr(module, name) for name in PROTOCOL_METHODS)
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    pp_group = mesh[PIPELINE_PARALLEL].get_group()
    dp_group = mesh[DATA_PARALLEL].get_group() if layout.data_parallel_enabled else None
    runner = PipelineRunner(result.stages, result.stage_ids, result.num_stages, schedule, microbatches,
                            loss_fn=per_microbatch_mean if mean_of_means else result.loss_fn,
                            device=torch.device("cpu"), group=pp_group, last_stage_rank=result.last_stage_rank,
                            data_parallel_size=layout.data_parallel, count_items=result.count_items)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    losses, counts = [], []
    per_rank = GLOBAL_BATCH // layout.data_parallel
    start = layout.coordinates(rank).data * per_rank
    for batch in batches():
        inputs, targets = result.adapter.split_batch({k: v[start : start + per_rank] for k, v in batch.items()})
        num_items = causal_lm_valid_count(targets)
        if dp_group is not None:
            dist.all_reduce(num_items, group=dp_group)
        counts.append([int(causal_lm_valid_count(t)) for t in targets.chunk(microbatches)])
        optimizer.zero_grad()
        loss = runner.train_step(inputs, targets, num_items=num_items)  # FSDP2 averages over the data axis
        clip_tied_once(list(module.parameters()), pp_group)
        optimizer.step()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / layout.data_parallel
        losses.append(float(loss.detach()))
    eval_loss, _ = runner.eval_step(inputs, targets, num_items=num_items)
    if dp_group is not None:
        dist.all_reduce(eval_loss, group=dp_group)
        eval_loss = eval_loss / layout.data_parallel
    losses.append(float(eval_loss))
    tied = {e.name: module.get_parameter(e.name).detach().clone() for e in result.tied}
    tied = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in tied.items()}
    keys = sorted(module.state_dict())
    return {"losses": losses, "counts": counts, "tied": tied, "keys": keys, "copies": [e.ranks for e in result.tied]}


class TwoStreams(torch.nn.Module):
    """A user's own model under the widened protocol: two tensors between layers, one side input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([Mix(), Mix()])
        self.out = Join()

    def pipeline_layers(self) -> list:
        return [self.inp, *self.blocks, self.out]

    def pipeline_side_inputs(self, x: torch.Tensor) -> dict:
        return {"row_scale": row_scale(x)}

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, row_scale=row_scale(x)) if isinstance(h, torch.Tensor) else block(*h, row_scale=row_scale(x))
        return self.out(*h)


def row_scale(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.sum(-1, keepdim=True))


class Mix(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, *streams: torch.Tensor, row_scale: torch.Tensor) -> tuple:
        joined = torch.cat(streams, dim=-1) if len(streams) > 1 else streams[0]
        return torch.tanh(self.a(joined)) * row_scale, torch.relu(self.b(joined))


class Join(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 1)

    def forward(self, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([h, g], dim=-1))


def stream_batches() -> list:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def stream_reference() -> list[float]:
    module = TwoStreams()
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    losses = []
    for x, y in stream_batches():
        optimizer.zero_grad()
        loss = module.pipeline_loss(module(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_streams(rank: int, layout: ParallelLayout) -> list[float]:
    options = ParallelOptions(1, 2, 1, microbatches=2, schedule="1f1b", partition="uniform")
    meshes = RunMeshes.build(layout, "cpu")
    mesh = meshes.run
    module = TwoStreams()
    result = parallelize(module, meshes=meshes, options=options, adapter=adapt(module))
    runner = PipelineRunner(result.stages, result.stage_ids, result.num_stages, "1f1b", 2, loss_fn=result.loss_fn,
                            device=torch.device("cpu"), group=mesh[PIPELINE_PARALLEL].get_group(),
                            last_stage_rank=result.last_stage_rank)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    losses = []
    for x, y in stream_batches():
        optimizer.zero_grad()
        losses.append(runner.train_step(x, y).item())
        optimizer.step()
    return losses


def two_process_runs(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    layout = ParallelLayout(world_size, 1, 2, 1)
    runs = {}
    for family, schedule, stages_per_rank in RUNS:
        runs[family, schedule] = train(rank, layout, family, schedule, stages_per_rank, 0, 4)
    runs["llama", "mean_of_means"] = train(rank, layout, "llama", "1f1b", 1, 0, 4, mean_of_means=True)
    runs["streams"] = train_streams(rank, layout)
    return runs


def four_process_runs(rank: int, world_size: int) -> dict:
    layout = ParallelLayout(world_size, 2, 2, 1)
    return {family: train(rank, layout, family, "1f1b", 1, 2, 2) for family in ("llama", "qwen2")}


def worst(losses: list[float], expected: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(losses, expected))


def check_tied_copies_identical(ranks: list[dict], run) -> None:
    """The embedding copy and the LM-head copy end bit-identical on the ranks that hold them."""
    values = [t for r in ranks for t in r[run]["tied"].values()]
    assert len(values) == 2, f"expected one tied pair on two ranks, got {len(values)} copies"
    assert torch.equal(values[0], values[1])


def test_pipeline_schedules_match_one_process_for_three_families():
    ranks = run_processes(two_process_runs, 2, timeout=400)
    figures = {(f, s): max(worst(r[f, s]["losses"], reference(f)) for r in ranks) for f, s, _ in RUNS}
    print("max |loss - one process|:", {f"{k[0]}/{k[1]}": f"{v:.2e}" for k, v in figures.items()})
    assert all(v < TOL for v in figures.values()), figures
    counts = ranks[0]["llama", "1f1b"]["counts"]
    assert any(len(set(step)) > 1 for step in counts), "micro-batches must differ in valid tokens"
    control = max(worst(r["llama", "mean_of_means"]["losses"], reference("llama")) for r in ranks)
    print(f"negative control (mean of per-micro-batch means): {control:.2e}")
    assert control > 1e-3, "the padded comparison must catch the mean of per-micro-batch means"
    streams = max(worst(r["streams"], stream_reference()) for r in ranks)
    print(f"protocol with two streams and a side input: {streams:.2e}")
    assert streams < TOL
    for schedule in ("1f1b", "interleaved_1f1b"):
        check_tied_copies_identical(ranks, ("qwen2", schedule))
        assert ranks[0]["llama", schedule]["tied"] == {}
    # Keys are the unsplit model's: together the ranks hold exactly one process's state-dict keys.
    for family in ("llama", "qwen2"):
        union = sorted(set(ranks[0][family, "1f1b"]["keys"]) | set(ranks[1][family, "1f1b"]["keys"]))
        assert union == sorted(UserModule(family).state_dict())


def test_data_and_pipeline_with_zero2_match_one_process():
    ranks = run_processes(four_process_runs, 4, timeout=400)
    figures = {f: max(worst(r[f]["losses"], reference(f)) for r in ranks) for f in ("llama", "qwen2")}
    print("dp2 x pp2 ZeRO-2 max |loss - one process|:", {k: f"{v:.2e}" for k, v in figures.items()})
    assert all(v < TOL for v in figures.values()), figures
    for data_rank in (0, 1):  # ranks (d, p): the copies of one data replica
        pair = [ranks[r] for r in range(4) if r // 2 == data_rank]
        check_tied_copies_identical(pair, "qwen2")
