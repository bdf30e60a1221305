"""Hugging Face MoE experts under expert parallelism, on a world of one: the plan, the refusals, the exact math.

The expert-parallel module must give transformers' own experts forward and gradients (its grouped-GEMM path, the
configs' default), keep the unsplit parameter names, and be what the engine treats as expert parameters; a model
the suite cannot shard is refused by ``check_module`` before any process starts, naming the cause.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.adapters.hf.experts import (  # noqa: E402
    HFExpertParallel,
    apply_hf_experts,
    check_hf_experts,
    expert_shards,
    hf_experts_modules,
)
from lightning_parallel.layout import ParallelLayout  # noqa: E402
from lightning_parallel.parallel.compose import check_module  # noqa: E402
from lightning_parallel.parallel.experts import expert_parameters, reduce_expert_gradients  # noqa: E402
from lightning_parallel.parallel.options import ParallelOptions  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)
EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def _config(family: str, **overrides):
    qwen = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    kwargs = {
        "qwen3_moe": qwen,
        "qwen2_moe": dict(qwen, shared_expert_intermediate_size=16),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "olmoe": dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1),
    }[family]
    return transformers.AutoConfig.for_model(family, **{**SMALL, **kwargs, **overrides})


class HFModule(pl.LightningModule):
    def __init__(self, config, meta: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            self.model = transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture
def expert_mesh(tmp_path):
    """A 1-D mesh of a world of one (the process group is destroyed after the test)."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("expert",))
    dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_the_models_own_ep_plan_names_each_layers_experts(family):
    module = HFModule(_config(family), meta=True)
    assert hf_experts_modules(module, "model") == ["model." + name for name in EXPERTS]
    assert check_hf_experts(module.model, 4) == EXPERTS


def test_qwen3_moe_with_dense_layers_shards_only_its_moe_layers():
    module = HFModule(_config("qwen3_moe", mlp_only_layers=[0]), meta=True)
    assert check_hf_experts(module.model, 2) == EXPERTS[1:]


def _refusal(config, layout: ParallelLayout) -> str:
    with pytest.raises(ValueError) as error:
        check_module(HFModule(config, meta=True), layout, ParallelOptions())
    return str(error.value)


DP2_EP2 = dict(data_parallel=2, expert_parallel=2)


def test_a_model_without_an_ep_plan_is_refused_naming_the_families_that_have_one():
    message = _refusal(transformers.LlamaConfig(**SMALL), ParallelLayout.resolve(2, **DP2_EP2))
    assert "LlamaForCausalLM (llama) has no expert-parallel plan" in message
    assert "families (EXPERT_FAMILIES, docs/hf-coverage.md)" in message and "expert_parallel_size=1" in message


def test_an_expert_count_the_size_does_not_divide_is_refused_with_the_sizes_that_do():
    config = _config("mixtral", num_local_experts=6)
    message = _refusal(config, ParallelLayout.resolve(4, data_parallel=4, expert_parallel=4))
    assert "holds 6 experts, which expert_parallel_size=4 does not divide: use a size among [1, 2, 3, 6]" in message


def test_experts_the_suite_does_not_compute_are_refused_by_layout_then_by_family(monkeypatch):
    from lightning_parallel.adapters.hf import experts as hf_experts

    config = transformers.GptOssConfig(**{**SMALL, "num_attention_heads": 4, "head_dim": 8}, num_local_experts=4,
                                       num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    message = _refusal(config, ParallelLayout.resolve(2, **DP2_EP2))
    assert "GptOssExperts) has an interleaved gate/up layout (is_concatenated=False)" in message
    config = transformers.AutoConfig.for_model("phimoe", **SMALL, num_local_experts=4, num_experts_per_tok=2)
    check_module(HFModule(config, meta=True), ParallelLayout.resolve(2, **DP2_EP2), ParallelOptions())  # measured
    monkeypatch.setattr(hf_experts, "EXPERT_FAMILIES", hf_experts.EXPERT_FAMILIES - {"phimoe"})
    message = _refusal(config, ParallelLayout.resolve(2, **DP2_EP2))  # the same layout, an unmeasured family
    assert "(phimoe)" in message and "PhimoeExperts is not among them" in message


def test_a_router_loss_is_made_global_under_expert_parallelism_and_refused_under_a_pipeline():
    config = _config("qwen3_moe", output_router_logits=True)
    check_module(HFModule(config, meta=True), ParallelLayout.resolve(2, **DP2_EP2), ParallelOptions())
    message = _refusal(config, ParallelLayout.resolve(4, pipeline_parallel=2, **DP2_EP2))
    assert "output_router_logits=True" in message and "pipeline_parallel_size=2" in message


def test_a_protocol_plan_on_the_module_still_wins():
    class Named(HFModule):
        def expert_parallel_plan(self):
            return {"model.model.layers.*.mlp.experts": "experts"}

    adapter = adapt(Named(_config("mixtral"), meta=True))
    with pytest.raises(ValueError, match="does not divide"):  # the protocol's check: w_up/num_experts on the module
        adapter.check_expert_parallel(3)


def _batch(vocab: int = 64):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_expert_parallel_experts_give_transformers_loss_and_gradients(expert_mesh, family):
    module = HFModule(_config(family))
    reference = copy.deepcopy(module)
    replaced = adapt(module).apply_expert_parallel(module, expert_mesh, None, None)
    assert replaced == ["model." + name for name in EXPERTS]
    assert all(isinstance(module.get_submodule(name), HFExpertParallel) for name in replaced)
    loss, loss_ref = module.model(**_batch()).loss, reference.model(**_batch()).loss
    loss.backward()
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) < 1e-6
    grads = dict(module.named_parameters())
    for name, param in reference.named_parameters():  # the same names, experts included
        grad = grads[name].grad
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        assert (grad - param.grad).abs().max() < 1e-6, name
    names = [name for name, _ in expert_parameters(module)]
    assert names == [f"model.{e}.{w}" for e in EXPERTS for w in ("gate_up_proj", "down_proj")]
    reduce_expert_gradients(module, None, data_ranks=2)
    up = grads[names[0]].grad.to_local()
    assert (up * 2 - dict(reference.named_parameters())[names[0]].grad).abs().max() < 1e-6


def test_the_kernel_path_matches_the_loop(expert_mesh):
    from lightning_parallel import _compat

    calls = []

    def kernel(*args):
        calls.append(args[0].shape)
        return _compat.grouped_mm(*args)

    module = HFModule(_config("qwen3_moe"))
    looped = copy.deepcopy(module)
    apply_hf_experts(module, "model", expert_mesh, kernel)
    apply_hf_experts(looped, "model", expert_mesh, None)
    assert abs(module.model(**_batch()).loss.item() - looped.model(**_batch()).loss.item()) < 1e-6
    assert len(calls) == 4  # up and down projections of both layers ran on the kernel


def test_a_rank_that_receives_no_rows_still_runs_forward_and_backward(expert_mesh):
    from lightning_parallel import _compat

    module = HFModule(_config("mixtral"))
    experts = HFExpertParallel(module.model.model.layers[0].mlp.experts, expert_mesh, _compat.grouped_mm)
    hidden = torch.zeros(0, 32, requires_grad=True)
    out = experts(hidden, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, 32) and float(experts.gate_up_proj.grad.to_local().abs().sum()) == 0.0


def test_a_meta_model_keeps_full_shapes_under_the_unsplit_names(expert_mesh):
    module = HFModule(_config("mixtral"), meta=True)
    apply_hf_experts(module, "model", expert_mesh)
    shards = expert_shards(module)
    assert shards["model.model.layers.0.mlp.experts.gate_up_proj"] == ((4, 64, 32), (4, 64, 32))
    assert shards["model.model.layers.1.mlp.experts.down_proj"] == ((4, 32, 32), (4, 32, 32))
    assert module.model.model.layers[0].mlp.experts.gate_up_proj.is_meta
    assert apply_hf_experts(module, "model", expert_mesh) == []  # applied once
