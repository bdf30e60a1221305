"""The only door to private or undocumented parts of Lightning, torch, DeepSpeed and transformers.

Every use of another package's private name (or of an internal with no documented
contract) goes through this module, with a one-line reason. ``tests/unit/test_compat.py``
asserts that each touch point still exists, with the signature relied on, in the installed
versions, so an upgrade fails in one named test instead of deep inside a training run.

Supported versions (``pyproject.toml`` pins the same ranges; CI installs inside them):
lightning 2.6, torch 2.13, deepspeed 0.19, torchdata 0.11, transformers 5 (optional).

Touch points, by package:

* Lightning: :func:`optimizers_to_device`,
  :func:`set_module_device_mesh`, :func:`init_model_parallel_process_group`,
  :data:`DDPForwardRedirection`, :func:`set_forward_redirection`,
  :data:`DEEPSPEED_STRATEGY_OVERRIDES` (private hooks the DeepSpeed strategy overrides),
  :func:`auto_select_batch_size`, :func:`init_deepspeed_distributed`,
  :func:`remove_module_hooks`, :func:`fit_loop_train_dataloader`, and the loop
  state-dict layout of :func:`epoch_end_loop_progress` / :func:`drop_loader_position`.
* torch: :func:`unflatten_mesh_dim`, :func:`dcp_set_element`, :func:`dcp_metadata_path`, :func:`load_planner_target`.
* DeepSpeed: :func:`zero_merge_trainable_params`, :func:`zero3_param_coordinator`.
* transformers: :func:`hf_class_plans`, :func:`hf_init_weights`, :func:`hf_checkpoint_conversions`,
  :func:`hf_rename_checkpoint_key`.
* TorchRec (torch's optimizer in backward): :func:`in_backward_optimizer_settings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

# --- Lightning ---------------------------------------------------------------------------



def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move optimizer state to ``device`` (Lightning's own helper, used by every built-in strategy's ``setup``)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_module_device_mesh(module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``module.device_mesh`` return ``mesh`` (read in ``configure_model``).

    Why private: ``LightningModule.device_mesh`` has no setter; Lightning's
    ModelParallelStrategy assigns ``_device_mesh`` the same way.
    """
    module._device_mesh = mesh


def init_model_parallel_process_group(strategy: Any, default_backend: Optional[str] = None) -> None:
    """Join the default process group as ModelParallelStrategy does (cluster env, ranks, backend, timeout).

    Why private: ``ModelParallelStrategy._setup_distributed`` is the only Lightning entry that
    does all of it; re-implementing it would copy ``_init_dist_connection`` (private as well).
    ``default_backend`` replaces Lightning's default by device when the user chose no backend
    (Lightning keeps the choice in ``_process_group_backend``).
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if default_backend is not None and strategy._process_group_backend is None:
        strategy._process_group_backend = default_backend
    ModelParallelStrategy._setup_distributed(strategy)


# Why private: Lightning's step redirection through a wrapped module (DeepSpeed's engine)
# has no public base class; the ZeRO-3 strategy refines it (see strategies/deepspeed.py).
DDPForwardRedirection = _DDPForwardRedirection


def set_forward_redirection(strategy: Any, redirection: Any) -> None:
    """Replace a DeepSpeed strategy's step redirection (no public setter; read by ``training_step`` & co)."""
    strategy._forward_redirection = redirection


# Private hooks of Lightning's DeepSpeedStrategy that DeepSpeedDataParallelStrategy overrides,
# with why. A rename upstream would silently bypass the override, so the compat test checks
# each still exists with these parameters.
DEEPSPEED_STRATEGY_OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "_setup_model_and_optimizer": (
        ("self", "model", "optimizer", "lr_scheduler"),
        "deepspeed.initialize with a device rank that exists on CPU",
    ),
    "_initialize_deepspeed_inference": (("self", "model"), "the same CPU-safe device rank for evaluation engines"),
    "_format_config": (("self",), "Trainer settings win over a raw config instead of being refused or ignored"),
}


def auto_select_batch_size(strategy: Any) -> int:
    """The train loader's batch size, as Lightning's DeepSpeedStrategy infers it for
    ``train_micro_batch_size_per_gpu``."""
    return strategy._auto_select_batch_size()


def init_deepspeed_distributed(strategy: Any) -> None:
    """Join the process group through DeepSpeed (Lightning's own step, minus its CUDA device-index check)."""
    strategy._init_deepspeed_distributed()


def remove_module_hooks(model: nn.Module) -> None:
    """Drop a training engine's hooks before an inference engine wraps the model (undocumented Lightning helper)."""
    from lightning.pytorch.strategies.deepspeed import remove_module_hooks as remove

    remove(model)


def fit_loop_train_dataloader(trainer: pl.Trainer) -> Any:
    """The training loader of a fit, however it was given (``fit(train_dataloaders=...)`` included).

    Why private: the public routes (``datamodule.train_dataloader()``,
    ``module.train_dataloader()``) miss loaders passed straight to ``fit``; the fit loop's
    data source is the one place that knows all three.
    """
    return trainer.fit_loop._data_source.dataloader()


# Lightning's fit-loop checkpoint layout (undocumented, 2.5-2.6): checkpoint key -> the
# progress object under ``trainer.fit_loop.epoch_loop`` that Lightning saves there.
_EPOCH_LOOP_PROGRESS = {
    "epoch_loop.batch_progress": ("batch_progress",),
    "epoch_loop.scheduler_progress": ("scheduler_progress",),
    "epoch_loop.automatic_optimization.optim_progress": ("automatic_optimization", "optim_progress"),
}


def drop_per_step_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning's training loop broadcasting rank 0's SIGTERM flag before every step (``_TrainingEpochLoop.
    _broadcast_sigterm_tensor``): a collective per step that a raw loop does not have. Only for a trainer whose
    SIGTERM the suite's handlers took (:class:`~lightning_parallel.callbacks.GracefulStop`): Lightning's flag is
    then never set, and the suite's own agreement carries the stop, every ``agree_every_s`` seconds.
    """
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def keep_lr_scheduler_marker(step: Any, wrapped: Any) -> None:
    """Mark ``step``, a replacement of ``optimizer.step`` that calls ``wrapped``, as torch's LR scheduler marks the
    step it wraps (``_wrapped_by_lr_sched``) when ``wrapped`` carries that mark: the scheduler's wrapper still runs,
    so its order check stays true, and torch does not warn that the step was overridden after the scheduler."""
    if hasattr(wrapped, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True


def fit_loop_state(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The fit loop's entry of a Lightning checkpoint dict (``checkpoint["loops"]["fit_loop"]``), or None."""
    return checkpoint.get("loops", {}).get("fit_loop")


def epoch_end_loop_progress(trainer: pl.Trainer) -> dict[str, Any]:
    """``{checkpoint key: live progress object}`` of the epoch loop's per-epoch counters."""
    out = {}
    for key, path in _EPOCH_LOOP_PROGRESS.items():
        value: Any = trainer.fit_loop.epoch_loop
        for attribute in path:
            value = getattr(value, attribute)
        out[key] = value
    return out


def drop_loader_position(fit_state: dict[str, Any]) -> None:
    """Remove the saved data-loader position from a fit-loop checkpoint entry.

    Lightning stores it as ``combined_loader``.
    """
    fit_state.get("state_dict", {}).pop("combined_loader", None)


# --- torch -------------------------------------------------------------------------------


def attention_implementation(model: nn.Module) -> Optional[str]:
    """The attention implementation a transformers model runs (``"sdpa"``, ``"eager"``, a registered name).

    Why private: transformers keeps it as ``config._attn_implementation`` and offers only a setter
    (``set_attn_implementation``); context parallelism checks that the switch took.
    """
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def can_set_attention_implementation(model: nn.Module) -> bool:
    """Whether ``set_attn_implementation`` can swap a transformers model's attention (it calls attention through
    ``AttentionInterface``). Why private: transformers' own test, ``_can_set_attn_implementation``, is private; a
    model without it (older transformers) is taken at its word."""
    check = getattr(type(model), "_can_set_attn_implementation", None)
    return callable(getattr(model, "set_attn_implementation", None)) and (not callable(check) or bool(check()))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ weight[g] [G, k, n]`` for the row groups ending at ``offsets`` (int32 cumulative counts).

    Why private: ``torch._grouped_mm`` is torch's only grouped GEMM (CPU and CUDA in 2.13), the kernel
    torchtitan's MoE uses; :mod:`lightning_parallel.parallel.experts.grouped` falls back to a loop where its
    alignment rules are not met.
    """
    return torch._grouped_mm(x, weight, offs=offsets)


def unflatten_mesh_dim(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A view of ``mesh`` with dimension ``dim`` split into ``sizes`` named ``names`` (same ranks, same root).

    Why private: FSDP2's HSDP needs a 2-D ``(replicate, shard)`` data mesh on the same root as
    the tensor-parallel DTensors, while the run keeps the 1-D ``data_parallel`` axis for its
    groups; torch 2.13 offers this only as ``DeviceMesh._unflatten`` (torchtitan's route), and
    the public alternative (a 4-D root plus ``_flatten``) warns on every flattened slice.
    """
    return mesh._unflatten(dim, sizes, names)


def dcp_set_element(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put ``value`` at a flattened-key path of a nested state dict, as DCP's DefaultLoadPlanner does.

    Why private: the allow-listed load planner replaces ``load_bytes`` and must store the
    value exactly where the default one would (``torch.distributed.checkpoint._traverse``).
    """
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dcp_metadata_path(reader: Any, rank: Optional[int]) -> Any:
    """Where a FileSystemReader finds ``.metadata`` (per-rank metadata files included); no public accessor."""
    return reader._get_metadata_path(rank)


def load_planner_target(planner: Any) -> tuple[bool, dict[str, Any], dict[str, Any], Any]:
    """A DefaultLoadPlanner's ``(flatten_state_dict, original_state_dict, state_dict, mappings)``.

    Undocumented attributes.
    """
    return planner.flatten_state_dict, planner.original_state_dict, planner.state_dict, planner.mappings


# --- DeepSpeed ---------------------------------------------------------------------------


def zero_merge_trainable_params(
    stage: int, merged: dict[str, Any], world_size: int, flat_per_rank: Any, model_states: Any, paddings: Any
) -> None:
    """Rebuild full tensors from ZeRO flat partitions into ``merged`` (``zero_to_fp32``'s private merges).

    Why private: DeepSpeed exposes only whole-checkpoint conversions; the per-state merge is
    what lets optimizer moments (laid out like the fp32 partitions) be re-split per parameter.
    """
    from deepspeed.utils import zero_to_fp32

    if stage <= 2:
        zero_to_fp32._zero2_merge_trainable_params(merged, world_size, flat_per_rank, model_states, paddings)
    else:
        zero_to_fp32._zero3_merge_trainable_params(merged, world_size, flat_per_rank, model_states)


def zero3_param_coordinator(engine: Any) -> Any:
    """The ZeRO-3 parameter coordinator of a DeepSpeed engine, or ``None`` (other stages, no engine yet).

    Undocumented: the coordinator's ``reset_step`` ends a traced step; the ZeRO-3 strategy
    runs it once per redirected Lightning step.
    """
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    if not callable(partitioned) or not partitioned():
        return None
    optimizer = getattr(engine, "optimizer", None)
    # Training engine: the ZeRO-3 optimizer holds the offload object; an engine without
    # optimizer (validate/test/predict) has the offload object as its optimizer.
    offload = getattr(optimizer, "parameter_offload", optimizer)
    get_coordinator = getattr(offload, "get_param_coordinator", None)
    return get_coordinator() if callable(get_coordinator) else None


def hf_class_plans(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The class-level ``(_tp_plan, _pp_plan)`` of a transformers model (empty dicts when absent).

    Why private: transformers keeps the LM head's part of its parallel plans (``lm_head``:
    ``colwise_gather_output`` / ``(["hidden_states"], ["logits"])``) only in these class
    attributes; the base model's part is public (``config.base_model_tp_plan``/``_pp_plan``).
    """
    cls = type(model)
    return dict(getattr(cls, "_tp_plan", None) or {}), dict(getattr(cls, "_pp_plan", None) or {})


def hf_init_weights(model: Any, module: nn.Module) -> None:
    """``model._init_weights(module)``: transformers' per-module initialiser (normal weights, ones for norms,
    the rotary ``inv_freq`` recomputed from the config), the one ``from_config`` applies to every module.

    Why private: transformers has no public per-module initialiser; its public ``init_weights()`` walks the
    whole model, which a rank holding one stage cannot do. The canary test builds a tiny Llama and checks
    the method exists and fills a meta-built module's rotary buffer.
    """
    model._init_weights(module)


# --- TorchRec ----------------------------------------------------------------------------


def in_backward_optimizer_settings(param: Any) -> Optional[tuple[type, dict[str, Any]]]:
    """``(optimizer class, kwargs)`` that ``apply_optimizer_in_backward`` attached to ``param``, or None.

    Why private: torch's optimizer-in-backward (which TorchRec's ``apply_optimizer_in_backward`` calls) keeps
    them only in the parameter's ``_optimizer_classes`` / ``_optimizer_kwargs`` lists; TorchRec's sharders read
    the same attributes to build a table's fused optimizer. A data-parallel table has no fused optimizer, so
    the suite reads them to give it the same optimizer. One optimizer per table, as TorchRec requires.
    """
    classes = getattr(param, "_optimizer_classes", None)
    kwargs = getattr(param, "_optimizer_kwargs", None)
    if not classes:
        return None
    return classes[0], dict(kwargs[0] if kwargs else {})


def hf_checkpoint_conversions(model: Any) -> list[Any]:
    """The ``WeightRenaming``/``WeightConverter`` list ``from_pretrained`` applies to ``model``'s checkpoint keys
    (``[]`` for a module that is not a transformers model).

    Why undocumented: transformers documents the converters and their operations (its "Dynamic weight loading"
    page) but not ``conversion_mapping.get_model_conversion_mapping``, which gathers a model's list (per-expert
    keys merged into ``gate_up_proj`` for the MoE families); the suite's folder loader matches keys exactly as
    ``from_pretrained`` does with it.
    """
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return []
    from transformers.conversion_mapping import get_model_conversion_mapping

    # transformers looks a model's list up by class name first (GPT-NeoX's ``embed_out`` -> ``lm_head``); FSDP2's
    # fully_shard swaps a module's class for ``FSDP<name>(FSDPModule, <class>)``: the lookup sees the class again.
    swapped = [(m, type(m)) for m in model.modules() if hasattr(m, "config") and _fsdp_original(type(m))]
    try:
        for module, cls in swapped:
            module.__class__ = _fsdp_original(cls)
        return list(get_model_conversion_mapping(model))
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _fsdp_original(cls: type) -> Optional[type]:
    """The class FSDP2's ``fully_shard`` derived ``cls`` from (``FSDP<name>`` with bases ``(FSDPModule, <name>)``)."""
    return next((base for base in cls.__bases__ if cls.__name__ == f"FSDP{base.__name__}"), None)


def hf_rename_checkpoint_key(
    key: str, renamings: list[Any], converters: list[Any], base_model_prefix: Optional[str], model_keys: Any
) -> tuple[str, Optional[str]]:
    """``(model key, the converter's source pattern or None)`` for a checkpoint key: every renaming, then at most
    one converter, then the base model's prefix added or taken off where ``model_keys`` says so.

    Why undocumented: ``core_model_loading.rename_source_key`` is the step of ``from_pretrained`` that does this,
    with no documented contract.
    """
    from transformers.core_model_loading import rename_source_key

    return rename_source_key(key, renamings, converters, base_model_prefix, model_keys)
