"""torch's private or undocumented parts the suite relies on: DeviceMesh, DCP's load planner and reader, the grouped
GEMM, the LR scheduler's step mark, the optimizer in backward (the door: :mod:`lightning_parallel._compat`).

Each touch point says why it is private; ``tests/unit/test_compat.py`` has a canary for each.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def keep_lr_scheduler_marker(step: Any, wrapped: Any) -> None:
    """Mark ``step``, a replacement of ``optimizer.step`` that calls ``wrapped``, as torch's LR scheduler marks the
    step it wraps (``_wrapped_by_lr_sched``) when ``wrapped`` carries that mark: the scheduler's wrapper still runs,
    so its order check stays true, and torch does not warn that the step was overridden after the scheduler."""
    if hasattr(wrapped, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ weight[g] [G, k, n]`` for the row groups ending at ``offsets`` (int32 cumulative counts).

    Why private: ``torch._grouped_mm`` is torch's only grouped GEMM (CPU and CUDA in 2.13), the kernel
    torchtitan's MoE uses; :mod:`lightning_parallel.parallel.experts.grouped` falls back to a loop where its
    alignment rules are not met.
    """
    return torch._grouped_mm(x, weight, offs=offsets)


def grouped_mm_operator() -> Any:
    """The dispatcher's operator behind :func:`grouped_mm` (``aten._grouped_mm.default``), which lp-simulate's MoE
    step on ``meta`` recognises: torch's meta rule for it is CUDA's and takes bf16 only, while the CPU kernel a real
    run takes also multiplies fp32 (``planner/simulation/routing.py`` asks the rule for the shapes in bf16).

    Why private: the operator is torch's private grouped GEMM.
    """
    return torch.ops.aten._grouped_mm.default


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


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of a world of ``world_size`` in which every collective returns at once, moving
    nothing (``lp-simulate``: one CPU process plays each rank class of a large world).

    Why private: torch's "fake" backend and its ``FakeStore`` live in ``torch.testing._internal.distributed.fake_pg``
    (importing it registers the backend); torch has no public way to build a world without processes.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # The fake backend for meta tensors too: a simulated step sends meta tensors point to point (batched send/recv
    # asks the group for a backend by the tensors' device type).
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage that views share, on ``meta`` too (lp-simulate counts saved activations
    by distinct storage).

    Why private: a ``meta`` storage has no data pointer (``data_ptr()`` is 0 for all of them) and each
    ``untyped_storage()`` call returns a new Python object; ``_cdata``, the address of the storage torch holds,
    is the only identity they share.
    """
    return tensor.untyped_storage()._cdata


def fsdp2_gathered_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters and all-gather outputs of every FSDP2 unit of ``module`` (lp-simulate leaves them
    out of the activations: they are counted as gathered parameters).

    Why private: FSDP2 keeps them on its ``FSDPParamGroup``'s ``FSDPParam`` objects (``all_gather_outputs``,
    ``_unsharded_param``), reached only through ``FSDPModule._get_fsdp_state()``.
    """
    from torch.distributed.fsdp import FSDPModule

    found = []
    for unit in module.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for param in getattr(group, "fsdp_params", ()):
            found.extend(getattr(param, "all_gather_outputs", ()))
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                found.append(unsharded.to_local() if hasattr(unsharded, "to_local") else unsharded)
    return found


def dispatch_mode() -> type:
    """torch's ``TorchDispatchMode`` class: a mode that sees every operator call below autograd, with its arguments
    (lp-simulate counts the ``c10d`` collectives of a step through one, as torch's own ``CommDebugMode`` does).

    Why private: the class lives in ``torch.utils._python_dispatch``; torch exports no public name for it.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (lp-simulate, between two simulated ranks of one process).

    Why private: DTensor caches each operator's output placements by the inputs' specs, which compare meshes by
    shape and names only, so a later world's step would be handed the earlier world's mesh object and its process
    group names (``Could not resolve the process group``); torch's only door is ``tensor.debug``'s private
    ``_clear_sharding_prop_cache``.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()



@contextmanager
def fsdp2_step_on_meta(module: torch.nn.Module) -> Iterator[None]:
    """Inside, FSDP2's units of ``module`` run forward and backward on ``meta`` parameters (lp-simulate measures a
    step's collectives and saved activations without materialising anything).

    Why private: FSDP2 refuses a step on ``meta`` (``FSDPParamGroup._validate_no_meta_params``), allocates its
    all-gather and reduce-scatter buffers on the mesh's device (``FSDPParamGroup.device``, ``FSDPParam.device``) and
    asks ``_get_device_handle(device.type)`` (a module global of its collectives, param group and state) for
    streams, which ``meta`` has none of: inside, the buffers are made on ``meta`` and the CPU's no-op streams are
    used; HSDP's all-reduce, which on a device other than the CPU must return an event (``foreach_reduce``, read by
    the param group's ``post_backward``), gets a CPU no-op event. Each is restored on the way out.

    Args:
        module: the parallelised model (its FSDP2 units).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group, _fsdp_state

    meta = torch.device("meta")
    groups = [m._get_fsdp_state()._fsdp_param_group for m in module.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    saved = [(g, g.device, [p.device for p in g.fsdp_params]) for g in groups]
    handles = [(m, m._get_device_handle) for m in (_fsdp_collectives, _fsdp_param_group, _fsdp_state)]
    reduce = _fsdp_param_group.foreach_reduce

    def reduce_with_event(*args: Any, **kwargs: Any) -> tuple:
        result = list(reduce(*args, **kwargs))
        if result[4] is not None and result[5] is None:  # all_reduce_input without all_reduce_event
            result[5] = torch.cpu.Event()
        return tuple(result)

    try:
        _fsdp_param_group.foreach_reduce = reduce_with_event
        for owner, original in handles:
            owner._get_device_handle = lambda kind, _o=original: _o("cpu" if kind == "meta" else kind)
        for group in groups:
            group.device, group._validate_no_meta_params = meta, lambda: None
            for param in group.fsdp_params:
                param.device = meta
        yield
    finally:
        _fsdp_param_group.foreach_reduce = reduce
        for owner, original in handles:
            owner._get_device_handle = original
        for group, device, devices in saved:
            group.device = device
            group.__dict__.pop("_validate_no_meta_params", None)
            for param, param_device in zip(group.fsdp_params, devices):
                param.device = param_device
