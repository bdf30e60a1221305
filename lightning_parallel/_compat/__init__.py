"""The only door to private or undocumented parts of Lightning, torch, DeepSpeed and transformers.

Every use of another package's private name (or of an internal with no documented
contract) goes through this package, with a one-line reason: one module per package it reaches into
(:mod:`.lightning_internals`, :mod:`.torch_internals`, :mod:`.deepspeed_internals`,
:mod:`.transformers_internals`), every name re-exported here, so callers write ``_compat.<name>``.
``tests/unit/test_compat.py`` asserts that each touch point still exists, with the signature relied on, in the installed
versions, so an upgrade fails in one named test instead of deep inside a training run.

Supported versions (``pyproject.toml`` pins the same ranges; CI installs inside them):
lightning 2.6, torch 2.13, deepspeed 0.19, torchdata 0.11, transformers 5 (optional).

Touch points, by package:

* Lightning: :func:`optimizers_to_device`,
  :func:`set_module_device_mesh`, :func:`init_model_parallel_process_group`,
  :data:`DDPForwardRedirection`, :func:`set_forward_redirection`,
  :data:`DEEPSPEED_STRATEGY_OVERRIDES` (private hooks the DeepSpeed strategy overrides),
  :func:`auto_select_batch_size`, :func:`init_deepspeed_distributed`,
  :func:`remove_module_hooks`, :func:`fit_loop_train_dataloader`, :func:`drop_per_step_sigterm_broadcast`,
  and the loop state-dict layout of :func:`fit_loop_state` / :func:`epoch_end_loop_progress` /
  :func:`drop_loader_position`.
* torch: :func:`unflatten_mesh_dim`, :func:`dcp_set_element`, :func:`dcp_metadata_path`, :func:`load_planner_target`,
  :func:`grouped_mm`, :func:`grouped_mm_operator` (lp-simulate's MoE step), :func:`keep_lr_scheduler_marker`,
  :func:`init_fake_process_group` (lp-simulate's world),
  :func:`fsdp2_step_on_meta`, :func:`clear_dtensor_caches`, :func:`dispatch_mode`, :func:`storage_key` and
  :func:`fsdp2_gathered_tensors` (lp-simulate's step),
  and for TorchRec (torch's optimizer in backward) :func:`in_backward_optimizer_settings`.
* DeepSpeed: :func:`zero_merge_trainable_params`, :func:`zero3_param_coordinator`, :func:`skip_inference_shm_comm`.
* transformers: :func:`hf_class_plans`, :func:`hf_init_weights`, :func:`hf_checkpoint_conversions`,
  :func:`hf_rename_checkpoint_key`, :func:`hf_masks_on_meta`,
  :func:`attention_implementation`, :func:`can_set_attention_implementation`.
"""

from lightning_parallel._compat.deepspeed_internals import (
    skip_inference_shm_comm,
    zero3_param_coordinator,
    zero_merge_trainable_params,
)
from lightning_parallel._compat.lightning_internals import (
    DEEPSPEED_STRATEGY_OVERRIDES,
    DDPForwardRedirection,
    auto_select_batch_size,
    drop_loader_position,
    drop_per_step_sigterm_broadcast,
    epoch_end_loop_progress,
    fit_loop_state,
    fit_loop_train_dataloader,
    init_deepspeed_distributed,
    init_model_parallel_process_group,
    optimizers_to_device,
    remove_module_hooks,
    set_forward_redirection,
    set_module_device_mesh,
)
from lightning_parallel._compat.torch_internals import (
    clear_dtensor_caches,
    dcp_metadata_path,
    dcp_set_element,
    dispatch_mode,
    fsdp2_gathered_tensors,
    fsdp2_step_on_meta,
    grouped_mm,
    grouped_mm_operator,
    in_backward_optimizer_settings,
    init_fake_process_group,
    keep_lr_scheduler_marker,
    load_planner_target,
    storage_key,
    unflatten_mesh_dim,
)
from lightning_parallel._compat.transformers_internals import (
    attention_implementation,
    can_set_attention_implementation,
    hf_checkpoint_conversions,
    hf_class_plans,
    hf_init_weights,
    hf_masks_on_meta,
    hf_rename_checkpoint_key,
)

__all__ = [
    "DDPForwardRedirection", "DEEPSPEED_STRATEGY_OVERRIDES", "attention_implementation", "auto_select_batch_size",
    "can_set_attention_implementation", "dcp_metadata_path", "dcp_set_element", "drop_loader_position",
    "drop_per_step_sigterm_broadcast", "epoch_end_loop_progress", "fit_loop_state", "fit_loop_train_dataloader",
    "fsdp2_step_on_meta", "clear_dtensor_caches", "dispatch_mode", "storage_key", "fsdp2_gathered_tensors",
    "grouped_mm", "grouped_mm_operator", "hf_checkpoint_conversions", "hf_class_plans", "hf_init_weights",
    "hf_masks_on_meta", "hf_rename_checkpoint_key",
    "in_backward_optimizer_settings", "init_deepspeed_distributed", "init_fake_process_group",
    "init_model_parallel_process_group",
    "keep_lr_scheduler_marker", "load_planner_target", "optimizers_to_device", "remove_module_hooks",
    "set_forward_redirection", "set_module_device_mesh", "skip_inference_shm_comm", "unflatten_mesh_dim",
    "zero3_param_coordinator", "zero_merge_trainable_params",
]
