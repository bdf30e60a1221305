"""Activation checkpointing on one process: exact under dropout, names unchanged, choices validated."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel import activation_checkpoint
from lightning_parallel.parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    describe_choice,
    is_checkpointed,
)
from lightning_parallel.adapters import adapt
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.compose import check_module, checkpoint_activations, parallelize
from lightning_parallel.parallel.options import ParallelOptions
from lightning_parallel.testing.models import ResidualMLP


def _gpt(dropout: float = 0.2):
    from examples.nlp.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4, dropout=dropout).build()


def _loss_and_grads(model, tokens) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(7)  # the same dropout stream for every variant
    loss = model.pipeline_loss(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("choice", ["full", "selective", ("blocks.*.attn", "blocks.1.mlp")])
def test_recomputation_under_dropout_is_exact_and_keeps_every_name(choice):
    model, tokens = _gpt(), torch.randint(0, 64, (4, 16))
    loss, grads = _loss_and_grads(copy.deepcopy(model), tokens)
    checkpointed = copy.deepcopy(model)
    chosen = checkpoint_activations(checkpointed, choice, adapter=adapt(checkpointed))
    assert chosen and all(is_checkpointed(m) for m in chosen)
    expected = 4 if isinstance(choice, str) else 3  # embed, 2 blocks, head; or two attentions and one MLP
    assert len(chosen) == expected
    # Checkpoints, plans and pipeline stages key on these names: nothing inserted, nothing renamed.
    assert list(checkpointed.state_dict()) == list(model.state_dict())
    assert [n for n, _ in checkpointed.named_modules()] == [n for n, _ in model.named_modules()]
    assert inspect.signature(checkpointed.blocks["0"].forward) == inspect.signature(model.blocks["0"].forward)
    new_loss, new_grads = _loss_and_grads(checkpointed, tokens)
    assert float((new_loss - loss).abs()) == 0.0 and _max_difference(new_grads, grads) == 0.0


def test_recomputation_without_the_rng_state_would_differ(monkeypatch):
    """Negative control: the exactness above rests on restoring the RNG state before recomputing dropout."""
    model, tokens = _gpt(), torch.randint(0, 64, (4, 16))
    _, grads = _loss_and_grads(copy.deepcopy(model), tokens)
    exact = activation_checkpoint.checkpoint
    monkeypatch.setattr(
        activation_checkpoint, "checkpoint", lambda *a, **k: exact(*a, **{**k, "preserve_rng_state": False})
    )
    checkpointed = copy.deepcopy(model)
    checkpoint_activations(checkpointed, "full", adapter=adapt(checkpointed))
    _, new_grads = _loss_and_grads(checkpointed, tokens)
    assert _max_difference(new_grads, grads) > 1e-4


class _BackwardOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("choice", "matmuls_again", "gelu_again"),
                         [("none", False, False), ("full", True, True), ("selective", False, True)])
def test_selective_recomputes_activations_but_no_matmul(choice, matmuls_again, gelu_again):
    model = _gpt()
    checkpoint_activations(model, choice, adapter=adapt(model)) if choice != "none" else None
    loss = model.pipeline_loss(model(torch.randint(0, 64, (2, 16))), torch.randint(0, 64, (2, 16)))
    with _BackwardOps() as ops:
        loss.backward()
    # Forward matmuls are addmm (backward uses mm); recomputed GELU runs its forward op again.
    assert (ops.counts.get("aten.addmm.default", 0) > 0) == matmuls_again, ops.counts
    assert (ops.counts.get("aten.gelu.default", 0) > 0) == gelu_again, ops.counts


def test_a_module_is_checkpointed_once():
    model = _gpt()
    checkpoint_activations(model, "full", adapter=adapt(model))
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        apply_activation_checkpointing([model.blocks["0"]])


@pytest.mark.parametrize(
    ("value", "message"),
    [("some", "not a mode"), ([], "non-empty list"), (["blocks.*", 3], "non-empty list"), (True, "neither a mode")],
)
def test_bad_choices_raise_naming_the_fix(value, message):
    with pytest.raises(ValueError, match=message):
        ParallelOptions(activation_checkpointing=value)


def test_choices_that_would_checkpoint_nothing_are_refused_before_any_process():
    layout = ParallelLayout.resolve(1)
    with pytest.raises(ValueError, match="'blocks.\\*.attention' names no submodule.*blocks.0"):
        check_module(_gpt(), layout, ParallelOptions(activation_checkpointing=["blocks.*.attention"]))
    with pytest.raises(ValueError, match="'blocks', a container without forward.*'blocks.\\*'"):
        check_module(_gpt(), layout, ParallelOptions(activation_checkpointing=["blocks"]))
    with pytest.raises(ValueError, match="neither pipeline_layers.*list of globs"):
        check_module(nn.Sequential(nn.Linear(4, 4)), layout, ParallelOptions(activation_checkpointing="full"))
    options = ParallelOptions(activation_checkpointing=["blocks.*"])  # a list from Hydra becomes a tuple
    assert options.activation_checkpointing == ("blocks.*",)
    check_module(_gpt(), layout, options)


def test_strategies_take_the_option_and_show_it_at_start_up():
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy

    strategy = HybridParallelStrategy(data_parallel_size=1, activation_checkpointing="selective")
    assert strategy.options.activation_checkpointing == "selective"
    assert strategy.startup_rows(ParallelLayout(1, 1, 1, 1))["activation checkpointing"].startswith("selective")
    zero3 = DeepSpeedDataParallelStrategy(zero_stage=3, activation_checkpointing=["blocks.*"])
    assert zero3.activation_checkpointing == ("blocks.*",)
    assert describe_choice(("blocks.*",)) == "blocks.* (full recomputation of these submodules)"
    with pytest.raises(ValueError, match="not a mode"):
        DeepSpeedDataParallelStrategy(activation_checkpointing="fulll")
    with pytest.raises(ValueError, match="not exact under DeepSpeed ZeRO-3.*'full'"):
        DeepSpeedDataParallelStrategy(zero_stage=3, activation_checkpointing="selective")
    DeepSpeedDataParallelStrategy(zero_stage=2, activation_checkpointing="selective")


def test_fsdp2_shards_the_checkpointed_layers_and_the_state_dict_keeps_its_names(tmp_path):
    """Checkpointing before FSDP2 (world of one): the FSDP2 units are the checkpointed layers, names unchanged."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layout = ParallelLayout(1, 1, 1, 1)
        module = ResidualMLP(width=16, depth=2)
        x, names = torch.randn(4, 16), list(module.state_dict())
        expected = module(x)
        options = ParallelOptions(data_parallel_size=1, zero_stage=3, activation_checkpointing="full")
        parallelize(module, meshes=RunMeshes.build(layout, "cpu", options.zero_stage), options=options,
                    adapter=adapt(module))
        assert all(is_checkpointed(m) and isinstance(m, FSDPModule) for m in module.pipeline_layers())
        torch.testing.assert_close(module(x), expected)
        assert list(get_model_state_dict(module)) == names
    finally:
        dist.destroy_process_group()


def test_selective_is_refused_under_a_split_backward_schedule():
    layout = ParallelLayout.resolve(2, data_parallel=1, pipeline_parallel=2)
    options = {"data_parallel_size": 1, "pipeline_parallel_size": 2, "schedule": "zbv", "stages_per_rank": 2}
    with pytest.raises(ValueError, match="'selective' cannot run under schedule='zbv'.*'full'"):
        check_module(_gpt(), layout, ParallelOptions(**options, activation_checkpointing="selective"))
    check_module(_gpt(), layout, ParallelOptions(**options, activation_checkpointing="full"))


@pytest.mark.parametrize("choice", ["full", "selective"])
def test_a_hugging_face_decoder_checkpoints_its_blocks_exactly(choice):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      attention_dropout=0.2)
    model = transformers.LlamaForCausalLM(config).train()
    tokens = torch.randint(0, 64, (2, 16))

    def loss_and_grads(m):
        torch.manual_seed(7)
        m(input_ids=tokens, labels=tokens).loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    grads = loss_and_grads(copy.deepcopy(model))
    checkpointed = copy.deepcopy(model)
    chosen = checkpoint_activations(checkpointed, choice, adapter=adapt(checkpointed))
    assert chosen == list(checkpointed.model.layers)  # the decoder blocks, keyword arguments and all
    assert checkpointed.config.use_cache is False  # a training-time KV cache would grow again in recomputation
    assert list(checkpointed.state_dict()) == list(model.state_dict())
    assert _max_difference(loss_and_grads(checkpointed), grads) == 0.0


def test_the_benchmarks_memory_counter_sees_what_checkpointing_keeps():
    """``benchmarks.activation_memory.LiveTensorBytes``: exact on a known sequence, and smaller under ``full``."""
    from benchmarks.activation_memory import LiveTensorBytes

    with LiveTensorBytes([]) as counter:
        a = torch.ones(1000)
        b = a * 2  # 8000 bytes alive together
        del a
        c = b + 1  # b and c: 8000 again, never 12000
    assert counter.peak == 8000 and c.numel() == 1000
    peaks = {}
    for choice in ("none", "full"):
        model = _gpt()
        checkpoint_activations(model, choice, adapter=adapt(model)) if choice != "none" else None
        tokens = torch.randint(0, 64, (4, 16))
        with LiveTensorBytes(list(model.parameters())) as counter:
            model.pipeline_loss(model(tokens), tokens).backward()
        peaks[choice] = counter.peak
    assert 0 < peaks["full"] < peaks["none"]
