"""Canaries: every private or undocumented API the suite reaches through ``lightning_parallel._compat`` still exists.

One test per touch point, so a Lightning, torch or DeepSpeed upgrade that moves one fails
here, by name, instead of deep inside a training run.
"""

import inspect
import re
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from torch import nn

from lightning_parallel import _compat

ROOT = Path(__file__).resolve().parents[2]


def _parameters(function) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def test_transformers_per_module_initialiser_fills_a_meta_built_rotary_buffer():
    """``hf_init_weights``: the per-module initialiser materialisation relies on (``_init_weights``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    rotary = model.model.rotary_emb
    rotary.to_empty(device="cpu")
    rotary.inv_freq.fill_(float("nan"))
    _compat.hf_init_weights(model, rotary)
    reference = transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb.inv_freq
    assert torch.equal(rotary.inv_freq, reference)


def test_lightning_optimizers_to_device_exists():
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    assert _parameters(_optimizers_to_device)[:2] == ("optimizers", "device")


def test_lightning_module_device_mesh_is_backed_by_the_private_attribute():
    module = pl.LightningModule()
    sentinel = object()
    _compat.set_module_device_mesh(module, sentinel)
    assert module.device_mesh is sentinel


def test_model_parallel_strategy_has_setup_distributed():
    assert _parameters(ModelParallelStrategy._setup_distributed) == ("self",)
    # It reads the timeout the suite passes to the constructor.
    assert "_timeout" in inspect.getsource(ModelParallelStrategy._setup_distributed)


def test_ddp_forward_redirection_base_exists():
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection

    assert _compat.DDPForwardRedirection is _DDPForwardRedirection
    assert callable(getattr(_DDPForwardRedirection, "__call__"))


def test_strategy_steps_go_through_the_forward_redirection_attribute():
    from lightning.pytorch.strategies import Strategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    sentinel = object()
    _compat.set_forward_redirection(strategy, sentinel)
    assert strategy._forward_redirection is sentinel
    assert "self._forward_redirection(" in inspect.getsource(Strategy.training_step)


@pytest.mark.parametrize("name", sorted(_compat.DEEPSPEED_STRATEGY_OVERRIDES))
def test_deepspeed_strategy_private_hooks_the_suite_overrides_exist(name):
    expected, _reason = _compat.DEEPSPEED_STRATEGY_OVERRIDES[name]
    assert _parameters(getattr(DeepSpeedStrategy, name)) == expected


@pytest.mark.parametrize("name", ["_auto_select_batch_size", "_init_deepspeed_distributed"])
def test_deepspeed_strategy_private_helpers_the_suite_calls_exist(name):
    assert _parameters(getattr(DeepSpeedStrategy, name)) == ("self",)


def test_lightning_remove_module_hooks_exists():
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks

    module = nn.Linear(2, 2)
    module.register_forward_hook(lambda *args: None)
    _compat.remove_module_hooks(module)
    assert not module._forward_hooks
    assert callable(remove_module_hooks)


def test_fit_loop_data_source_exists():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert callable(trainer.fit_loop._data_source.dataloader)


def test_fit_loop_checkpoint_layout_has_the_keys_exact_resume_rewrites():
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    progress = _compat.epoch_end_loop_progress(trainer)
    saved = trainer.fit_loop.state_dict()
    for key, live in progress.items():
        assert key in saved, key
        assert saved[key] == live.state_dict()
        assert callable(live.reset_on_run)
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [1]}}}}
    _compat.drop_loader_position(_compat.fit_loop_state(checkpoint))
    assert checkpoint["loops"]["fit_loop"]["state_dict"] == {}


def test_transformers_attention_implementation_is_read_and_checked_through_compat():
    import pytest

    transformers = pytest.importorskip("transformers")
    from lightning_parallel import _compat

    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2))
    model.set_attn_implementation("eager")
    assert _compat.attention_implementation(model) == "eager"
    assert _compat.can_set_attention_implementation(model)


def test_grouped_mm_multiplies_each_row_group_by_its_own_matrix():
    import torch

    from lightning_parallel import _compat

    x, w = torch.randn(6, 4), torch.randn(2, 4, 8)
    offsets = torch.tensor([2, 6], dtype=torch.int32)  # rows 0-1 by w[0], rows 2-5 by w[1]
    expected = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    torch.testing.assert_close(_compat.grouped_mm(x, w, offsets), expected)


def test_grouped_mm_operator_is_the_kernel_and_its_meta_rule_still_takes_bf16_only():
    """lp-simulate's MoE step asks the meta rule in bf16 (``planner/simulation/routing.py``): when torch's rule takes
    fp32 too, that detour can go."""
    import torch

    from lightning_parallel import _compat

    operator = _compat.grouped_mm_operator()
    x, w = torch.empty(6, 16, device="meta"), torch.empty(2, 16, 32, device="meta")
    offsets = torch.empty(2, dtype=torch.int32, device="meta")
    assert operator(x.bfloat16(), w.bfloat16(), offsets).shape == (6, 32)
    with pytest.raises(RuntimeError, match="BF16"):
        operator(x, w, offsets)


def test_device_mesh_unflatten_takes_dim_sizes_and_names():
    import inspect

    from torch.distributed.device_mesh import DeviceMesh

    params = list(inspect.signature(DeviceMesh._unflatten).parameters)
    assert params[:4] == ["self", "dim", "mesh_sizes", "mesh_dim_names"]


def test_fake_process_group_plays_one_rank_of_a_large_world():
    """``init_fake_process_group``: torch's "fake" backend (``torch.testing._internal.distributed.fake_pg``), which
    ``lp-simulate`` plays every rank class in; its collectives return without moving anything."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    _compat.init_fake_process_group(5, 4096)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (5, 4096)
        dist.all_reduce(torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_fsdp2_step_on_meta_runs_forward_and_backward_of_a_meta_model_in_the_fake_world():
    """``fsdp2_step_on_meta`` (FSDP2's param group ``device``/``_validate_no_meta_params``, the modules'
    ``_get_device_handle``, ``foreach_reduce``'s HSDP event) and ``clear_dtensor_caches``: a ZeRO-3 and an HSDP unit
    on ``meta`` run a step; gradients are ``meta`` shards; everything is restored after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    _compat.init_fake_process_group(0, 4)
    try:
        for shape, names in (((4,), ("shard",)), ((2, 2), ("replicate", "shard"))):
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
            fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
            with _compat.fsdp2_step_on_meta(model):
                model(torch.randn(2, 8, device="meta")).sum().backward()
            assert all(p.grad.to_local().device.type == "meta" for p in model.parameters())
            group = model._get_fsdp_state()._fsdp_param_group
            assert group.device.type == "cpu" and "_validate_no_meta_params" not in group.__dict__
    finally:
        dist.destroy_process_group()
        _compat.clear_dtensor_caches()


def test_hf_masks_on_meta_answers_one_document_per_row():
    """``hf_masks_on_meta``: transformers' ``masking_utils.find_packed_sequence_indices`` reads position values."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    original = masking_utils.find_packed_sequence_indices
    with _compat.hf_masks_on_meta():
        assert masking_utils.find_packed_sequence_indices(torch.zeros(2, 4, dtype=torch.long, device="meta")) is None
        assert masking_utils.find_packed_sequence_indices(torch.arange(4).repeat(2, 1)) is None
    assert masking_utils.find_packed_sequence_indices is original


def test_dcp_set_element_exists():
    from torch.distributed.checkpoint._traverse import set_element

    root = {}
    _compat.dcp_set_element(root, ("a", "b"), 3)
    assert root == {"a": {"b": 3}} and callable(set_element)


def test_dcp_file_system_reader_metadata_path(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    path = _compat.dcp_metadata_path(FileSystemReader(tmp_path), None)
    assert str(path).endswith(".metadata")


def test_dcp_default_load_planner_attributes():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

    planner = DefaultLoadPlanner()
    planner.set_up_planner({"a": torch.zeros(1)}, Metadata(state_dict_metadata={}), is_coordinator=True)
    flatten, original, state, mappings = _compat.load_planner_target(planner)
    assert flatten is True and "a" in original and "a" in state and isinstance(mappings, dict)


@pytest.mark.parametrize(
    ("stage", "name", "arity"), [(2, "_zero2_merge_trainable_params", 5), (3, "_zero3_merge_trainable_params", 4)]
)
def test_deepspeed_zero_merge_functions_exist(stage, name, arity):
    from deepspeed.utils import zero_to_fp32

    assert len(_parameters(getattr(zero_to_fp32, name))) == arity


def test_deepspeed_zero3_coordinator_lookup_is_none_without_zero3():
    assert _compat.zero3_param_coordinator(object()) is None
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    assert callable(PartitionedParameterCoordinator.reset_step)


def test_no_private_name_of_another_package_is_touched_outside_compat():
    """``grep -rn "\\._[a-z]" lightning_parallel/`` outside _compat/ finds only the suite's own names."""
    output = subprocess.run(["grep", "-rn", r"\._[a-z]", "lightning_parallel/", "--include=*.py"], cwd=ROOT,
                            capture_output=True, text=True).stdout
    # os._exit is documented public API (exit without cleanup, for a forked child or a stopped launcher);
    # Hydra's `_target_` key and ATen operator names (`aten._scaled_dot_product_...`) are public names.
    own = re.compile(r"\b(self|cls|strategy|runner|planner_self)\._[a-z]|lightning_parallel\.(_compat|_[a-z])"
                     r"|\bos\._exit\(|\._target_\b|\baten\._[a-z]")
    offenders = [line for line in output.splitlines()
                 if not line.startswith("lightning_parallel/_compat/") and not own.search(line)]
    assert offenders == []


def _lightning_private_attributes(cls) -> set[str]:
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("lightning."):
            names |= {n for n in vars(base) if n.startswith("_") and not n.startswith("__")}
            try:
                names |= set(re.findall(r"self\.(_[a-z]\w*)\s*[:=]", inspect.getsource(base)))
            except (OSError, TypeError):
                pass
    return names


def test_the_suite_strategies_use_no_private_attribute_of_their_lightning_bases_outside_compat():
    """``self._x`` in a strategy must be the suite's own, not an inherited Lightning private."""
    from lightning_parallel.strategies import DeepSpeedDataParallelStrategy, HybridParallelStrategy

    allowed = set(_compat.DEEPSPEED_STRATEGY_OVERRIDES)  # overridden on purpose, canaried above
    for cls, room in ((HybridParallelStrategy, "hybrid"), (DeepSpeedDataParallelStrategy, "deepspeed")):
        # the whole room: its mixins (checkpoints, run views) and helpers are given the strategy as `self` too
        for path in sorted((ROOT / "lightning_parallel" / "strategies" / room).glob("*.py")):
            source = path.read_text()
            used = set(re.findall(r"(?:self|strategy)\.(_[a-z]\w*)", source)) | set(re.findall(r"def (_[a-z]\w*)", source))
            clashes = (used & _lightning_private_attributes(cls)) - allowed
            assert clashes == set(), f"{path.name}: {sorted(clashes)}"



def test_transformers_causal_lms_keep_the_lm_head_plans_on_the_class():
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    tp_plan, pp_plan = _compat.hf_class_plans(model)
    assert tp_plan == {"lm_head": "colwise_gather_output"}
    assert list(pp_plan) == ["lm_head"]


def test_in_backward_optimizer_settings_are_read_from_the_parameter():
    """torch's optimizer in backward (TorchRec's ``apply_optimizer_in_backward``) still records the class and kwargs."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    layer = nn.Linear(2, 2)
    assert _compat.in_backward_optimizer_settings(layer.weight) is None
    _apply_optimizer_in_backward(torch.optim.Adagrad, [layer.weight], {"lr": 0.05})
    assert _compat.in_backward_optimizer_settings(layer.weight) == (torch.optim.Adagrad, {"lr": 0.05})


def test_transformers_conversion_mapping_stacks_mixtrals_per_expert_keys():
    """``hf_checkpoint_conversions`` / ``hf_rename_checkpoint_key``: the list ``from_pretrained`` uses, and its key
    step, with the converter fields the folder loader reads (``source_patterns``, ``target_patterns``, ``operations``
    with ``dim``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    conversions = _compat.hf_checkpoint_conversions(model)
    renamings = [c for c in conversions if not hasattr(c, "operations")]
    converters = [c for c in conversions if hasattr(c, "operations")]
    known = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    key = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    renamed, pattern = _compat.hf_rename_checkpoint_key(key, renamings, converters, "model", known)
    assert renamed == "model.layers.0.mlp.experts.gate_up_proj" and pattern == ".experts.*.w3.weight"
    converter = next(c for c in converters if pattern in c.source_patterns)
    assert [(type(op).__name__, op.dim) for op in converter.operations] == [("MergeModulelist", 0), ("Concatenate", 1)]
    assert _compat.hf_checkpoint_conversions(nn.Linear(2, 2)) == []


def test_transformers_class_keyed_conversions_are_found_under_fsdp2s_class_rename():
    """GPT-NeoX's list (``embed_out`` -> ``lm_head``) is keyed by class name; FSDP2 derives ``FSDP<name>`` from
    ``(FSDPModule, <class>)`` (checked in its source), which ``hf_checkpoint_conversions`` sees through."""
    import inspect

    transformers = pytest.importorskip("transformers")
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    derive = inspect.getsource(_fsdp_init._apply_to_module)
    assert "{wrapper_cls_prefix}{cls.__name__}" in derive and "(wrapper_module_cls, cls)" in derive
    assert 'FSDPModule, "FSDP"' in inspect.getsource(_fully_shard.fully_shard)
    config = transformers.GPTNeoXConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    cls = type(model)
    model.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    sources = [c.source_patterns for c in _compat.hf_checkpoint_conversions(model)]
    assert [r"^embed_out\."] in sources and type(model).__name__ == "FSDPGPTNeoXForCausalLM"


def test_new_groups_without_a_timeout_read_the_module_default_the_mesh_timeout_patches():
    import inspect
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    from lightning_parallel._compat.c10d_internals import default_group_timeout

    assert "default_pg_timeout" in inspect.getsource(c10d._get_default_timeout)
    with default_group_timeout(timedelta(seconds=7)):
        assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(seconds=7)
    assert c10d._get_default_timeout(c10d.Backend.GLOO) == timedelta(minutes=30)


def test_dispatch_mode_sees_the_collectives_of_a_fake_world():
    """``dispatch_mode``: torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``) sees ``c10d`` ops."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    seen = []

    class Seen(_compat.dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.namespace)
            return func(*args, **(kwargs or {}))

    _compat.init_fake_process_group(0, 4)
    try:
        with Seen():
            dist.all_reduce(torch.ones(2))
    finally:
        dist.destroy_process_group()
    assert "c10d" in seen


def test_deepspeed_shm_comm_switch_is_the_one_its_backend_consults():
    """The op skip_inference_shm_comm marks unavailable is the one DeepSpeed's comm backend would compile."""
    import importlib
    import inspect

    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    from lightning_parallel._compat import skip_inference_shm_comm

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the module, not the torch it imports
    assert "__compatible_ops__" in inspect.getsource(ds_torch.build_shm_op)
    skip_inference_shm_comm()
    assert deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] is False
    assert ds_torch.build_shm_op() is None  # nothing compiled, nothing loaded
