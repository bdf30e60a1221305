"""The planner's inputs from a composed ``lp-train`` config: the model's shape, the batch and the world.

The model is instantiated from ``cfg.model`` (random init, on this machine; its ``configure_model()`` run, as the
Trainer would) and measured on one batch of ``cfg.data``: what ``lp-train`` would build, so the parameters are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torch import nn

from lightning_parallel.planner.candidates import CHECKPOINTING, Candidate, Workload
from lightning_parallel.planner.shapes import LayerShape, ModelShape, Param
from lightning_parallel.scaling import Reference


def workload_of(cfg: Any) -> Workload:
    """The batch, accumulation, lr and scaling rule ``lp-train`` would start from (``scaling.apply_to`` paths)."""
    from omegaconf import OmegaConf

    targets = cfg.scaling.apply_to
    reference = Reference(**OmegaConf.to_container(cfg.scaling.reference, resolve=True))
    select = lambda path: OmegaConf.select(cfg, path)  # noqa: E731
    warmup = select(targets.warmup_steps) if targets.get("warmup_steps") else 0
    return Workload(cfg.scaling.rule, reference, int(select(targets.micro_batch_size)),
                    int(select(targets.accumulate_grad_batches) or 1), float(select(targets.lr)), int(warmup or 0))


def checkpointing_modes() -> tuple[str, ...]:
    """The activation checkpointing modes the hybrid strategy offers (``none`` alone until it has the option)."""
    from dataclasses import fields

    from lightning_parallel.parallel.options import ParallelOptions

    return CHECKPOINTING if any(f.name == "activation_checkpointing" for f in fields(ParallelOptions)) else ("none",)


def optimizer_states(cfg: Any, model: Any = None) -> float:
    """Optimizer state tensors per parameter of ``cfg.model.optimizer`` (2 for Adam/AdamW, 1 for Lion or SGD with
    momentum, 0 for plain SGD; for ``MuonWithAdamW`` the mean over the groups ``model.configure_optimizers()``
    builds: 1 per Muon matrix element (its momentum), 2 per AdamW one)."""
    target = str(cfg.model.get("optimizer", {}).get("_target_", "torch.optim.AdamW"))
    name = target.rsplit(".", 1)[-1].lower()
    if name == "muonwithadamw":
        return 2.0 if model is None else _muon_states(model)
    if name.startswith("adam") or name in ("lamb", "lion"):
        return 1 if name == "lion" else 2
    return 1 if name == "sgd" and cfg.model.optimizer.get("momentum") else 0


_optimizer_states = optimizer_states  # the name this module used before


def _muon_states(model: Any) -> float:
    built = model.configure_optimizers()
    optimizer = built["optimizer"] if isinstance(built, dict) else built
    counts = [(sum(p.numel() for p in g["params"]), 1 if g.get("use_muon") else 2) for g in optimizer.param_groups]
    total = sum(n for n, _ in counts)
    return sum(n * k for n, k in counts) / total if total else 2.0


def _unique_params(layer: nn.Module, plan: Mapping[str, Any], prefix: str,
                   experts: frozenset[int] = frozenset()) -> tuple[Param, ...]:
    """``layer``'s parameters (a tied one once) with the dimension the tensor plan shards, and whether they are
    experts (held by modules whose ids are in ``experts``)."""
    from lightning_parallel.planner.profile import _BIAS_SHARDED, _WEIGHT_DIM, _style_of

    params, seen = [], set()
    for module_name, module in layer.named_modules():
        style = _style_of(module_name, plan, prefix) if module_name else _style_of("", plan, prefix.rstrip("."))
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                dim = _WEIGHT_DIM.get(style) if name == "weight" else (0 if style in _BIAS_SHARDED else None)
                params.append(Param(tuple(param.shape), dim, id(module) in experts))
    return tuple(params)


def state_shape(module: nn.Module, pipelined: bool, optimizer_states: int = 2, param_bytes: int = 4,
                sequence_parallel: bool = False) -> ModelShape:
    """The parameters of ``module`` (built, on any device including ``meta``) as the planner's memory model needs them.

    No FLOPs, activations or times: what :func:`lightning_parallel.planner.memory.state_bytes` reads. The layers are
    the pipeline layers of the module's adapter when ``pipelined`` (one layer holding everything otherwise); which
    dimension tensor parallelism shards comes from the adapter's tensor plan.

    Args:
        module: the model, with its layers created.
        pipelined: whether the run cuts the model into pipeline stages.
        optimizer_states: optimizer state tensors per parameter.
        param_bytes: bytes per parameter element.
        sequence_parallel: the tensor plan's sequence-parallel entries (they shard no parameter).
    """
    from lightning_parallel.parallel.adapter import ModelAdapter
    from lightning_parallel.planner.profile import _experts_modules

    adapter = ModelAdapter.resolve(module)
    tops = {id(m) for m in _experts_modules(module).values()}  # the experts modules; their parameters are experts
    experts = frozenset(id(m) for top in _experts_modules(module).values() for m in top.modules())
    plan = adapter.tensor_plan(sequence_parallel)[1]
    if pipelined:
        pipeline = adapter.pipeline_plan()
        named = list(zip(pipeline.names, pipeline.layers))
    else:
        named = [("", module)]
    layers = tuple(LayerShape(name or "model", _unique_params(layer, plan, f"{name}." if name else "", experts), 0.0,
                              0.0, 0.0, 0.0, moe_modules=sum(id(m) in tops for m in layer.modules()))
                   for name, layer in named)
    return ModelShape(type(module).__name__, layers, param_bytes=param_bytes, optimizer_states=optimizer_states,
                      source="parameters of the built model")


def expected_state_bytes(shape: ModelShape, candidate: Candidate) -> tuple[float, float, float]:
    """``(parameters, gradients, optimizer state)`` bytes of the most loaded rank of ``candidate``.

    The planner's memory model (:mod:`lightning_parallel.planner.memory`): pipeline stages cut by parameters,
    tensor-parallel shards, FSDP2 or DeepSpeed ZeRO partitions.
    """
    from lightning_parallel.planner.memory import stage_layers, state_bytes

    ranks = [[i for stage in rank for i in stage] for rank in stage_layers(shape, candidate)]
    return max((state_bytes(shape, candidate, layers) for layers in ranks), key=sum)


def shape_of(cfg: Any) -> ModelShape:
    """Instantiate ``cfg.model`` and measure it on one batch of ``cfg.data`` (seed ``cfg.seed``).

    Raises:
        ValueError: the model offers no ``pipeline_layers()``, or its first layer does not take one tensor.
    """
    import torch
    from hydra.utils import instantiate

    from lightning_parallel.parallel.adapter import ModelAdapter
    from lightning_parallel.planner.profile import profile_module

    torch.manual_seed(int(cfg.get("seed", 0)))
    model = instantiate(cfg.model)
    on_meta = builds_in_configure_model(model)  # decides the setup peak (planner.memory.setup_bytes)
    getattr(model, "configure_model", lambda: None)()  # layers created there (the recipes): with storage, seeded
    if not hasattr(model, "pipeline_layers"):
        raise ValueError(f"{type(model).__name__} offers no pipeline_layers(): the planner measures a model layer by "
                         "layer (see the module protocol in docs/protocol.md), or plan a published shape with --shape.")
    data = instantiate(cfg.data)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    inputs, _ = ModelAdapter.resolve(model).split_batch(batch)  # the planner's entry: resolved here, once
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"{type(model).__name__}'s first pipeline layer takes {type(inputs).__name__}, not one "
                         "tensor: the planner can measure only single-tensor inputs; plan with a cluster whose "
                         "compute is 'peak' after describing the model, or plan a published shape with --shape.")
    name = str(cfg.model._target_).rsplit(".", 1)[-1]
    shape = profile_module(model, inputs, name=name, optimizer_states=_optimizer_states(cfg, model))
    return replace(shape, built_on_meta=on_meta)


def builds_in_configure_model(model: Any) -> bool:
    """Whether ``model`` builds its layers in its own ``configure_model`` (on ``meta`` under the suite's strategies:
    each rank allocates only its share) rather than in ``__init__`` (with storage: whole on every rank first).

    Args:
        model: the instantiated ``cfg.model``.
    """
    return any("configure_model" in vars(cls) for cls in type(model).__mro__
               if not cls.__module__.startswith(("lightning.", "pytorch_lightning.")))
